"""`speclane bench device --stack`: a random-weight model of a real shape served
through the whole stack (`speclane serve`: drafter, verifier on the device,
gateway) and driven over its OpenAI API, HumanEval prompts in a closed loop,
with `none`, `ngram` and `suffix` at each concurrency: what a user of the
device would see, next to the in-process engine rates and limits that
`speclane bench device` reports for the same model.

Random weights make acceptance an artefact of the model (it repeats itself),
so the speculative rows say what the machinery costs and allows there, not
what a trained model gains. Requests ignore EOS, so every one decodes
`--max-tokens`.
"""

import asyncio
import os
import pathlib
import subprocess
import sys
import uuid

from speclane.net import free_port, wait_http_ok
from speclane_cli.bench.client import closed_loop, served_models
from speclane_cli.bench.stats import summarize
from speclane_cli.bench.workloads import load_workload
from speclane_cli.supervisor import terminate

METHODS = ("none", "ngram", "suffix")


def add_arguments(group) -> None:
    group.add_argument("--stack", action="store_true",
                       help="also serve each model through `speclane serve` on the device and measure tokens/s "
                            "over the HTTP API with --stack-methods at --stack-concurrency")
    group.add_argument("--stack-concurrency", default="1,64", help="comma-separated closed-loop concurrencies")
    group.add_argument("--stack-methods", default=",".join(METHODS), help="comma-separated speculation methods")
    group.add_argument("--stack-max-tokens", type=int, default=64, help="tokens every request decodes")
    group.add_argument("--tokenizer", default="smollm2-135m-instruct",
                       help="packaged model name or directory whose tokenizer and chat template the random models "
                            "get (their vocabularies are cut to its size)")


def served_rates(model_dir: pathlib.Path, device: str, log_path: pathlib.Path, args) -> list:
    """The model in `model_dir` (with a tokenizer) served with the bench's dtype and verifier settings, and
    its rows (stack_rates)."""
    # The in-process rows already report the start-up check of this model; a random model's check is no reason to
    # leave its served rates out.
    extra = ["--attention-backend", args.attention_backend, "--batch-invariant", args.batch_invariant,
             "--reference-check", "warn"]
    process, url = serve(model_dir, device, args.dtype, log_path, extra)
    try:
        return stack_rates(url, served_models(url)[0], [int(c) for c in args.stack_concurrency.split(",")],
                           args.stack_methods.split(","), args.stack_max_tokens)
    finally:
        stop(process)


def serve(model_dir: pathlib.Path, device: str, dtype: str, log_path: pathlib.Path, extra: list[str]):
    """Starts `speclane serve` on the model; returns (process, base URL) once it answers /health."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "speclane_cli", "serve", str(model_dir), "--port", str(port),
         "--grpc-port", str(free_port()), "--device", device, "--dtype", dtype, "--log-level", "warning",
         "--snapshot-path", str(model_dir / "drafter.snapshot"), *extra],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", process, timeout=900)
    except BaseException:
        stop(process)
        raise
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> None:
    terminate(process, 60)


def stack_rates(url: str, model_name: str, concurrencies: list[int], methods: list[str], max_tokens: int) -> list:
    """Output tokens/s of each (concurrency, method), HumanEval prompts in a closed loop; a row per pair."""
    rows, run_id = [], uuid.uuid4().hex[:8]
    for concurrency in concurrencies:
        conversations = load_workload("humaneval", max(2 * concurrency, 4), 0, 1)
        for method in methods:
            fields = {"model": model_name, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                      "speculation": {"method": method}}
            results, seconds = asyncio.run(closed_loop(url, conversations, concurrency, fields,
                                                       tenant=f"device-{run_id}-c{concurrency}-{method}",
                                                       on_request=lambda _: None))
            stats = summarize("humaneval", concurrency, method, results, seconds)
            if stats.failed:
                raise RuntimeError(f"{method} at concurrency {concurrency}: {stats.failed} requests failed: "
                                   f"{stats.errors}")
            per_step = stats.tokens_per_step
            rows.append({"concurrency": concurrency, "method": method, "tokens_per_s": round(stats.throughput_tps, 1),
                         "tokens_per_step": None if per_step is None else round(per_step, 2),
                         "mean_tpot_ms": round(stats.mean_tpot_ms or 0, 2)})
            print(rows[-1], flush=True)
    for row in rows:
        none = next((r for r in rows if r["concurrency"] == row["concurrency"] and r["method"] == "none"), None)
        if none and row is not none:
            row["vs_none"] = round(row["tokens_per_s"] / none["tokens_per_s"], 3)
    return rows
