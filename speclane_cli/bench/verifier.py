"""`speclane bench verifier`: the verifier engine's goals, side by side in one run.

- throughput: tokens/s of 8 concurrent greedy requests vs 1 at a time, through
  the real `speclane serve` stack (OpenAI HTTP API), with speculation off,
  suffix (chain) and suffix tree drafts; each run has its own tenant, so the
  drafter's global tree never holds the answers of an earlier run;
- verify overhead: one engine verify step of k draft tokens vs a bare
  transformers forward of the same k+1 input tokens on a DynamicCache of the
  same context (medians, interleaved);
- KV: 64 sequences of 1k tokens in a 64k-token budget (tiny random model).
"""

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from speclane.models import DEFAULT_MODEL, resolve_model
from speclane.net import free_port, wait_http_ok

MODES = {"none": {"method": "none"}, "suffix": {"method": "suffix"},
         "suffix-tree": {"method": "suffix", "suffix_decoding_use_tree_spec": True}}


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or directory")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--context", type=int, default=512, help="context length of the verify-overhead step")
    parser.add_argument("--draft-len", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "overhead", "kv"])
    parser.add_argument("--json", default="", help="also write the results to this file")


def verify_overhead(model_dir: str, context: int, k: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    from verifier_service.block_manager import BlockManager
    from verifier_service.engine import Engine
    from verifier_service.model_runner import ModelRunner
    from verifier_service.sequence import Draft, GenerationParams

    torch.set_num_threads(1)
    runner = ModelRunner(model_dir, "cpu", torch.float32)
    engine = Engine(runner, BlockManager(-(-(context + 4 * repeats + 256) // 64), 64, False))
    prompt = [(i * 7919) % (runner.vocab_size - 200) + 100 for i in range(context)]
    seq = engine.open("overhead", prompt, GenerationParams(max_new_tokens=repeats * 3, ignore_eos=True))
    engine.prefill(seq)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(torch.tensor([seq.tokens[:-1]]), past_key_values=cache, use_cache=True)
    engine_times, bare_times, bare_k_times = [], [], []
    for _ in range(repeats):
        # A draft the target rejects: every step commits one token, so both caches grow alike.
        draft = tuple(((seq.tokens[-1] + 1 + i) % runner.vocab_size) for i in range(k))
        fed = [seq.tokens[-1], *draft]
        with torch.inference_mode():
            keep = cache.get_seq_length()
            started = time.perf_counter()
            hf(torch.tensor([fed[1:]]), past_key_values=cache, use_cache=True)
            bare_k_times.append(time.perf_counter() - started)
            cache.crop(-(cache.get_seq_length() - keep))  # transformers 5: a negative count to remove
            started = time.perf_counter()
            hf(torch.tensor([fed]), past_key_values=cache, use_cache=True)
            bare_times.append(time.perf_counter() - started)
            cache.crop(-(cache.get_seq_length() - keep - 1))
        started = time.perf_counter()
        engine.verify(seq, Draft(draft))
        engine_times.append(time.perf_counter() - started)
    engine_ms, bare_ms = statistics.median(engine_times) * 1e3, statistics.median(bare_times) * 1e3
    bare_k_ms = statistics.median(bare_k_times) * 1e3
    return {"context": context, "draft_len": k, "engine_verify_ms": round(engine_ms, 2),
            "bare_forward_k_plus_1_ms": round(bare_ms, 2), "bare_forward_k_ms": round(bare_k_ms, 2),
            "ratio": round(engine_ms / bare_ms, 3), "ratio_vs_k_tokens": round(engine_ms / bare_k_ms, 3)}


def kv_budget(num_seqs: int = 64, seq_tokens: int = 1024, prompt_len: int = 1000) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from verifier_service.block_manager import BlockManager
    from verifier_service.engine import Engine
    from verifier_service.model_runner import ModelRunner
    from verifier_service.scheduler import BatchLimits
    from verifier_service.sequence import Draft, GenerationParams

    with tempfile.TemporaryDirectory() as path:
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        runner = ModelRunner(path, "cpu", torch.float32)
    engine = Engine(runner, BlockManager(num_seqs * seq_tokens // 16, 16, False),
                    BatchLimits(max_tokens=2048, max_sequences=128, max_queue_wait=3600))
    params = GenerationParams(max_new_tokens=seq_tokens - prompt_len, ignore_eos=True)
    seqs = [engine.open(f"s{i}", [(i + j) % 60 + 4 for j in range(prompt_len)], params) for i in range(num_seqs + 1)]
    answered = [0] * len(seqs)
    boxes = [[] for _ in seqs]
    for seq, box in zip(seqs, boxes):
        engine.submit(seq, Draft(), box.append)
    most_used, extra_admitted_early, started = 0, False, time.perf_counter()
    while not all(s.finished for s in seqs):
        engine.step()
        most_used = max(most_used, engine.blocks.used_blocks * engine.blocks.block_size)
        extra_admitted_early |= seqs[-1].blocks is not None and not any(s.finished for s in seqs[:-1])
        for i, (seq, box) in enumerate(zip(seqs, boxes)):
            if len(box) > answered[i]:
                answered[i] = len(box)
                if not seq.finished:
                    engine.submit(seq, Draft(), box.append)
    engine.step()
    return {"budget_tokens": engine.blocks.max_tokens, "peak_used_tokens": most_used,
            "65th_waited": not extra_admitted_early, "all_finished": all(s.finished for s in seqs),
            "pool_empty_after": engine.blocks.used_blocks == 0,
            "seconds": round(time.perf_counter() - started, 2)}


def _humaneval_messages(count: int) -> list[list[dict]]:
    from speclane_cli.datasets import humaneval_problems

    return [[{"role": "user", "content": f"Complete this Python function.\n```python\n{p['prompt']}```"}]
            for p in humaneval_problems()[:count]]


async def _run_requests(url: str, model: str, prompts, speculation: dict, concurrency: int, max_tokens: int,
                        tenant: str) -> dict:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)

    async def one(client, messages):
        async with semaphore:
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "speculation": speculation}
            reply = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-tenant-id": tenant})
            reply.raise_for_status()
            return reply.json()["usage"]

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        usages = await asyncio.gather(*(one(client, m) for m in prompts))
        seconds = time.perf_counter() - started
    tokens = sum(u["completion_tokens"] for u in usages)
    drafts = sum(u["speculation"]["draft_tokens"] for u in usages)
    accepted = sum(u["speculation"]["accepted_tokens"] for u in usages)
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
            "acceptance": round(accepted / drafts, 3) if drafts else None}


def throughput(model: str, concurrency: int, max_tokens: int, serve_args: list[str]) -> dict:
    """Starts `speclane serve`, then per speculation mode runs the same prompts one
    at a time and `concurrency` at a time."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "speclane_cli", "serve",
               "--model", model, "--port", str(port), "--grpc-port", str(free_port()), "--log-level", "warning",
               *serve_args]
    process = subprocess.Popen(command, start_new_session=True)
    results = {}
    try:
        wait_http_ok(f"{url}/health", process)
        prompts = _humaneval_messages(concurrency)
        asyncio.run(_run_requests(url, model, prompts[:1], MODES["none"], 1, 8, "bench-warm-up"))
        for mode, speculation in MODES.items():
            for level in (1, concurrency):
                results[f"{mode}@{level}"] = asyncio.run(_run_requests(
                    url, model, prompts, speculation, level, max_tokens, f"bench-{mode}-{level}-{time.time()}"))
        for mode in MODES:
            results[f"{mode}_speedup"] = round(results[f"{mode}@{concurrency}"]["tokens_per_s"]
                                               / results[f"{mode}@1"]["tokens_per_s"], 2)
    finally:
        process.terminate()
        process.wait(60)
    return results


def run(args) -> int:
    results = {}
    if "overhead" not in args.skip:
        results["verify_overhead"] = verify_overhead(str(resolve_model(args.model)), args.context,
                                                     args.draft_len, args.repeats)
        print(json.dumps({"verify_overhead": results["verify_overhead"]}), flush=True)
    if "kv" not in args.skip:
        results["kv"] = kv_budget()
        print(json.dumps({"kv": results["kv"]}), flush=True)
    if "throughput" not in args.skip:
        results["throughput"] = throughput(args.model, args.concurrency, args.max_tokens, [])
        print(json.dumps({"throughput": results["throughput"]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
