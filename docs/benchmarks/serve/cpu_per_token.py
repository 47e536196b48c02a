"""Each service's CPU time per output token while `speclane serve` streams to many clients: what caps the whole
stack's tokens/s once the verifier's device is fast. (On an H200 the stack served 1,588 tokens/s at 64 streams
where its engine decodes 3,915; docs/benchmarks/device.) CPU time, unlike wall time, holds on this shared 2-core
host: a service that spends c ms of CPU an output token can pass at most 1,000 / c tokens a second on one core.

    python docs/benchmarks/serve/cpu_per_token.py --model smollm2-135m-instruct --concurrency 64 \\
        --max-tokens 64 --methods none,suffix
"""

import argparse
import asyncio
import json
import pathlib
import tempfile
import uuid

import psutil

from speclane.models import resolve_model
from speclane_cli.bench import device_stack
from speclane_cli.bench.client import closed_loop, served_models
from speclane_cli.bench.stats import summarize
from speclane_cli.bench.workloads import load_workload

SERVICES = ("gateway", "verifier_service", "drafter_service")


def cpu_seconds(server: psutil.Process) -> dict[str, float]:
    """User and system CPU seconds of each service `server` runs (their threads and children included)."""
    spent = dict.fromkeys(SERVICES, 0.0)
    for process in server.children(recursive=True):
        command = process.cmdline()
        service = command[command.index("-m") + 1] if "-m" in command else ""
        if service in spent:
            times = process.cpu_times()
            spent[service] += times.user + times.system
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--methods", default="none,suffix")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        process, url = device_stack.serve(resolve_model(args.model), "cpu", args.dtype,
                                          pathlib.Path(scratch) / "serve.log", [])
        try:
            server, model = psutil.Process(process.pid), served_models(url)[0]
            conversations = load_workload("humaneval", args.requests * args.concurrency, 0, 1)
            for method in args.methods.split(","):
                fields = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                          "speculation": {"method": method}}
                before = cpu_seconds(server)
                results, seconds = asyncio.run(closed_loop(url, conversations, args.concurrency, fields,
                                                           tenant=f"cpu-{uuid.uuid4().hex[:8]}",
                                                           on_request=lambda _: None))
                after = cpu_seconds(server)
                stats = summarize("humaneval", args.concurrency, method, results, seconds)
                tokens = sum(result.output_tokens for result in results if result.ok)
                print(json.dumps({"method": method, "concurrency": args.concurrency, "failed": stats.failed,
                                  "tokens_per_s": round(stats.throughput_tps, 1), "output_tokens": tokens,
                                  **{f"{service} cpu ms a token": round((after[service] - before[service])
                                                                        / tokens * 1e3, 3)
                                     for service in SERVICES}}), flush=True)
        finally:
            device_stack.stop(process)


if __name__ == "__main__":
    main()
