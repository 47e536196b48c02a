"""`speclane bench verifier`: the verifier engine's goals, side by side in one run.

- overhead: one pass of the engine (paged cache, one attention call per layer)
  against transformers' own padded batched forward (SDPA, a DynamicCache) of
  the same batch, on a tiny deep random model where the host's work is what
  a pass costs: 64 sequences of 100 tokens (and of 50 to 150, which
  transformers pads and masks), 1 new token each (decode) and 5 (a chain
  verify); medians of interleaved repeats;
- memory: the KV 64 live sequences of mixed lengths hold against their
  tokens' own, and the tokens 16 concurrent requests sharing a 1,000-token
  system prompt compute against their unique prompt tokens;
- judging: the host time of a pass outside its forward (logit controls,
  acceptance, the tokens' bookkeeping) at 64 sequences, greedy, sampled,
  sampled with top-p, with Qwen3's and Qwen2.5's defaults (the latter's
  with a repetition penalty) and greedy with that penalty, decoding,
  verifying 3-token chains and 6-node trees, unseeded requests on a tiny
  model with SmolLM2's vocabulary; medians of repeated passes, and the
  operations torch dispatches in a pass (on an accelerator, each a kernel
  launch);
- scale: decode tokens/s of SmolLM2 in process at 32, 64 and 128 sequences;
- throughput: 8 concurrent greedy requests against 1 at a time through the
  real `speclane serve` stack, with speculation off and suffix decoding.
"""

import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speclane.models import DEFAULT_MODEL, resolve_model
from speclane.net import free_port, wait_http_ok

MODES = {"none": {"method": "none"}, "suffix": {"method": "suffix"}}
SECTIONS = ("overhead", "memory", "judging", "scale", "throughput")
BLOCK = 16


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or directory (scale, throughput)")
    parser.add_argument("--layers", default="24,48", help="comma-separated depths of the overhead model")
    parser.add_argument("--sequences", type=int, default=64, help="sequences in the overhead batch")
    parser.add_argument("--context", type=int, default=100, help="tokens each overhead sequence holds")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--scale", default="32,64,128", help="comma-separated batch sizes of the scale section")
    parser.add_argument("--concurrency", type=int, default=8, help="of the throughput section")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per throughput request")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    parser.add_argument("--json", default="", help="also write the results to this file")


def _tiny_llama(path: str, layers: int, max_context: int = 2048, vocab_size: int = 512) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def pass_overhead(layers: int, num_seqs: int, context: int, repeats: int, mixed: bool = False) -> list[dict]:
    """Medians of the engine's pass and transformers' batched forward, 1 and 5 new tokens a sequence.
    Mixed: contexts drawn from [context / 2, 3 context / 2], which transformers pads on the left and masks."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from verifier_service.batch import Segment, StepPlan
    from verifier_service.block_manager import BlockManager, BlockTable
    from verifier_service.model_runner import ModelRunner

    with tempfile.TemporaryDirectory() as path:
        _tiny_llama(path, layers)
        runner = ModelRunner(path, "cpu", torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    rng = random.Random(0)
    lengths = [rng.randint(context // 2, 3 * context // 2) if mixed else context for _ in range(num_seqs)]
    longest = max(lengths)
    blocks = BlockManager(num_seqs * -(-(longest + 8) // BLOCK), BLOCK, False)
    runner.allocate_cache(blocks.num_blocks, BLOCK)
    prompts = [[(s * 31 + i * 7) % 500 + 4 for i in range(n)] for s, n in enumerate(lengths)]
    tables = []
    for prompt in prompts:
        tables.append(BlockTable())
        blocks.allocate(tables[-1], prompt, len(prompt) + 8)
    for first in range(0, num_seqs, 8):  # prefill, 8 sequences a pass
        group = range(first, min(first + 8, num_seqs))
        runner.execute(StepPlan((), tuple(t for s in group for t in prompts[s]),
                                tuple(Segment(tuple(tables[s].blocks), 0, lengths[s]) for s in group)))
    padded = torch.tensor([[0] * (longest - n) + p for n, p in zip(lengths, prompts)])
    attention = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths])
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(padded, attention_mask=attention, past_key_values=cache, use_cache=True)
    rows = []
    for new in (1, 5):
        parents = tuple(range(-1, new - 2))  # a chain of new - 1 draft tokens after the pending one
        fed = [[(s + j) % 500 + 4 for j in range(new)] for s in range(num_seqs)]
        plan = StepPlan((), tuple(t for f in fed for t in f),
                        tuple(Segment(tuple(tables[s].blocks), lengths[s], 1, parents) for s in range(num_seqs)))
        mask = torch.cat([attention, torch.ones(num_seqs, new, dtype=torch.long)], dim=1)
        positions = torch.tensor([[n + j for j in range(new)] for n in lengths])
        ours, theirs = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            runner.execute(plan)
            ours.append(time.perf_counter() - started)
            with torch.inference_mode():
                started = time.perf_counter()
                hf(torch.tensor(fed), attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=True)
                theirs.append(time.perf_counter() - started)
                cache.crop(-new)  # transformers 5: a negative count to remove
        ours_ms, theirs_ms = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        rows.append({"layers": layers, "sequences": num_seqs, "context": f"{context // 2}-{3 * context // 2}"
                     if mixed else context, "new_tokens": new, "engine_ms": round(ours_ms, 2),
                     "transformers_ms": round(theirs_ms, 2), "ratio": round(ours_ms / theirs_ms, 3)})
    return rows


def _drive(engine, answers) -> None:
    """Steps until every sequence is answered once more (the caller resubmits)."""
    while not all(answers):
        engine.step()


def memory() -> dict:
    """Mixed-length live sequences' KV against their tokens', and a shared system prompt's computed tokens."""
    from verifier_service.block_manager import BlockManager
    from verifier_service.engine import Engine
    from verifier_service.model_runner import ModelRunner
    from verifier_service.scheduler import BatchLimits
    from verifier_service.sequence import Draft, GenerationParams

    with tempfile.TemporaryDirectory() as path:
        runner = ModelRunner(_tiny_llama(path, 2), "cpu", torch.float32)
    rng = random.Random(0)
    limits = BatchLimits(max_tokens=4096, max_sequences=128, max_queue_wait=3600)
    params = GenerationParams(max_new_tokens=4, ignore_eos=True)
    engine = Engine(runner, BlockManager(64 * 1024 // BLOCK, BLOCK, False), limits)
    seqs = [engine.open(f"m{i}", [rng.randrange(4, 500) for _ in range(rng.randrange(50, 1000))], params)
            for i in range(64)]
    answers = [[] for _ in seqs]
    for seq, box in zip(seqs, answers):
        engine.submit(seq, Draft(), box.append)
    _drive(engine, answers)
    held = engine.blocks.used_blocks * BLOCK
    tokens = sum(seq.num_cached for seq in seqs)

    passes = []
    engine = Engine(runner, BlockManager(64 * 1024 // BLOCK, BLOCK, True), limits, on_step=passes.append)
    system = [rng.randrange(4, 500) for _ in range(1000)]
    prompts = [system + [rng.randrange(4, 500) for _ in range(20)] for _ in range(16)]
    shared = [engine.open(f"p{i}", p, params) for i, p in enumerate(prompts)]
    answers = [[] for _ in shared]
    for seq, box in zip(shared, answers):
        engine.submit(seq, Draft(), box.append)
    _drive(engine, answers)
    computed, unique = sum(p.num_tokens for p in passes), len(system) + 16 * 20
    return {"live_sequences": 64, "kv_tokens_held": held, "tokens": tokens, "held_ratio": round(held / tokens, 3),
            "shared_prompt_requests": 16, "computed_tokens": computed, "unique_prompt_tokens": unique,
            "computed_ratio": round(computed / unique, 3), "block_size": BLOCK}


# The gateway applies a model's generation_config.json to requests that leave its settings out
# (--generation-config auto, as vLLM): Qwen3's are temperature 0.6, top-k 20 and top-p 0.95; Qwen2.5-Instruct's
# add a repetition penalty, a logit control of every sequence.
JUDGED = (("greedy", {}), ("sampled", {"temperature": 0.8}),
          ("sampled, top-p 0.95", {"temperature": 0.8, "top_p": 0.95}),
          ("Qwen3's defaults", {"temperature": 0.6, "top_k": 20, "top_p": 0.95}),
          ("Qwen2.5's defaults", {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}),
          ("greedy, repetition penalty 1.05", {"repetition_penalty": 1.05}))


class OperationCount(TorchDispatchMode):
    """Counts the operations torch dispatches in its scope on this thread: on an accelerator each is a kernel
    launch (the engine's own CPU kernels are called directly and not counted)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


# The drafts a judged pass verifies: none (a decode), a 3-token chain, and a tree of 6 nodes (two children at the
# root and under each of them, EAGLE's top-2 to depth 2).
JUDGED_DRAFTS = {"none": (0, ()), "chain": (3, ()), "tree": (6, (-1, -1, 0, 0, 1, 1))}


def _submit_drafts(engine, seqs, k: int, parents: tuple[int, ...], vocab_size: int) -> list[list]:
    """Each sequence's next step with a draft of that shape continuing its last token (distinct tokens: the
    greedy target rejects them all, a sampled one mostly); the boxes its answers land in."""
    from verifier_service.sequence import Draft

    answers = [[] for _ in seqs]
    for seq, box in zip(seqs, answers):
        engine.submit(seq, Draft(tuple((seq.tokens[-1] + j + 1) % vocab_size for j in range(k)), parents=parents),
                      box.append)
    return answers


def judging(num_seqs: int, repeats: int, vocab_size: int = 49152) -> list[dict]:
    """Medians of a pass's time and of its forward's, and their difference, the host's work around the forward,
    for each of JUDGED's settings with each of JUDGED_DRAFTS, the requests unseeded as most are."""
    from verifier_service.block_manager import BlockManager
    from verifier_service.engine import Engine
    from verifier_service.model_runner import ModelRunner
    from verifier_service.sampling import SamplingParams
    from verifier_service.scheduler import BatchLimits
    from verifier_service.sequence import Draft, GenerationParams

    with tempfile.TemporaryDirectory() as path:
        runner = ModelRunner(_tiny_llama(path, 2, vocab_size=vocab_size), "cpu", torch.float32)
    rows, forwards = [], []
    for name, sampling in JUDGED:
        for draft, (k, parents) in JUDGED_DRAFTS.items():
            engine = Engine(runner, BlockManager(num_seqs * 16, BLOCK, False),
                            BatchLimits(max_tokens=4096, max_sequences=num_seqs, max_queue_wait=3600),
                            on_step=lambda stats: forwards.append(stats.forward_seconds))
            params = GenerationParams(max_new_tokens=(repeats + 3) * (k + 1), ignore_eos=True,
                                      sampling=SamplingParams(**sampling))
            seqs = [engine.open(f"j{i}", [(i * 31 + j * 7) % (vocab_size - 4) + 4 for j in range(64)], params)
                    for i in range(num_seqs)]
            engine.run_together([(seq, Draft()) for seq in seqs])
            passes, forward = [], []
            for _ in range(repeats + 1):  # the first pass warms up
                answers = _submit_drafts(engine, seqs, k, parents, vocab_size)
                counted, started = len(forwards), time.perf_counter()
                _drive(engine, answers)
                passes.append(time.perf_counter() - started)
                forward.append(sum(forwards[counted:]))
            answers = _submit_drafts(engine, seqs, k, parents, vocab_size)
            with OperationCount() as operations:
                _drive(engine, answers)
            pass_ms, forward_ms = statistics.median(passes[1:]) * 1e3, statistics.median(forward[1:]) * 1e3
            rows.append({"sampling": name, "draft": draft, "draft_tokens": k, "sequences": num_seqs,
                         "vocab": vocab_size, "pass_ms": round(pass_ms, 2), "forward_ms": round(forward_ms, 2),
                         "host_ms": round(pass_ms - forward_ms, 2), "operations": operations.count})
            for seq in seqs:
                engine.close(seq)
    return rows


def scale(model_dir: str, sizes: list[int], steps: int = 4) -> list[dict]:
    """Decode tokens/s of `model_dir` in process with each number of sequences running."""
    from verifier_service.block_manager import BlockManager
    from verifier_service.device import set_threads
    from verifier_service.engine import Engine
    from verifier_service.model_runner import ModelRunner
    from verifier_service.scheduler import BatchLimits
    from verifier_service.sequence import Draft, GenerationParams

    set_threads(0)
    runner = ModelRunner(model_dir, "cpu", torch.float32)
    rows = []
    for size in sizes:
        engine = Engine(runner, BlockManager(size * 8, BLOCK, False),
                        BatchLimits(max_tokens=4096, max_sequences=size, max_queue_wait=3600))
        params = GenerationParams(max_new_tokens=steps + 2, ignore_eos=True)
        seqs = [engine.open(f"s{i}", [(i * 97 + j * 13) % 40000 + 100 for j in range(32)], params)
                for i in range(size)]
        engine.run_together([(seq, Draft()) for seq in seqs])
        engine.run_together([(seq, Draft()) for seq in seqs])  # a first decode pass: warm
        started = time.perf_counter()
        for _ in range(steps):
            engine.run_together([(seq, Draft()) for seq in seqs])
        seconds = time.perf_counter() - started
        rows.append({"sequences": size, "tokens_per_s": round(size * steps / seconds, 1),
                     "pass_ms": round(seconds / steps * 1e3, 1), "threads": torch.get_num_threads()})
        for seq in seqs:
            engine.close(seq)
    return rows


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
    torch.set_num_threads(1)  # the overhead and memory sections; scale takes the verifier's default
    results = {}

    def report(name, value):
        results[name] = value
        print(json.dumps({name: value}), flush=True)

    if "overhead" not in args.skip:
        report("overhead", [row for layers in args.layers.split(",") for mixed in (False, True)
                            for row in pass_overhead(int(layers), args.sequences, args.context, args.repeats,
                                                     mixed)])
    if "memory" not in args.skip:
        report("memory", memory())
    if "judging" not in args.skip:
        report("judging", judging(args.sequences, args.repeats))
    if "scale" not in args.skip:
        report("scale", scale(str(resolve_model(args.model)), [int(n) for n in args.scale.split(",")]))
    if "throughput" not in args.skip:
        report("throughput", throughput(args.model, args.concurrency, args.max_tokens, []))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
