"""`speclane bench head`: what a draft head costs next to the target and what
it buys, in-process on one thread, medians of interleaved repeats:

- cost: the head's draft of k tokens (feeding the step's new pairs, then k
  draft steps) against one verify step of the target with that draft, at the
  given context;
- acceptance: greedy generations on held-out ShareGPT prompts (the bench's
  pool; heads we ship are trained on other conversations), tokens per verify
  step and time per token against plain decoding, for each k;
- batching (--batch): several sequences' drafts made together, one head step
  for all, against one after another.

Each is measured for chains and, with --eagle-topk, EAGLE-2 trees of k levels.
"""

import copy
import json
import statistics
import time

import torch

from speclane.models import DEFAULT_MODEL, resolve_model


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="target model name or directory")
    parser.add_argument("--method", default="eagle3", choices=["eagle", "eagle3", "mtp"])
    parser.add_argument("--head", default="", help="head directory (default: the shipped head, or the target's MTP)")
    parser.add_argument("--k", default="1,2,3,4", help="comma-separated draft lengths (a tree's: its levels)")
    parser.add_argument("--eagle-topk", default="1", help="comma-separated tree widths, as the speculative config's "
                        "eagle_topk (1: chains)")
    parser.add_argument("--num-draft-tokens", type=int, default=0,
                        help="a tree's nodes at most, as the speculative config's num_draft_tokens (0: topk x k)")
    parser.add_argument("--context", type=int, default=512, help="context of the cost measurement")
    parser.add_argument("--batch", default="1", help="comma-separated sequence counts: above 1, also time that many "
                        "sequences' drafts made together against one after another")
    parser.add_argument("--temperature", type=float, default=0.0, help="the drafts' temperature in the batch "
                        "timing (0: greedy)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--token-cost", default="0", help="the verifier's draft_token_cost: a number, or auto to "
                        "measure it here (0: every draft is k long)")
    parser.add_argument("--head-dtype", default="auto", help="the head's dtype, as the verifier's --head-dtype")
    parser.add_argument("--json", default="", help="also write the results to this file")


def _engine(runner, drafter, max_tokens: int):
    from verifier_service.block_manager import BlockManager
    from verifier_service.engine import Engine

    return Engine(runner, BlockManager(-(-max_tokens // 64), 64, False), head=drafter)


def draft_cost(runner, drafter, context: int, k: int, repeats: int) -> dict:
    """Median seconds of the head's draft and of the verify step that checks it."""
    from verifier_service.sequence import GenerationParams

    engine = _engine(runner, drafter, context + (k + 1) * (repeats + 2) + 64)
    prompt = [(i * 7919) % (runner.vocab_size - 200) + 100 for i in range(context)]
    seq = engine.open("cost", prompt, GenerationParams(max_new_tokens=(k + 1) * (repeats + 2), ignore_eos=True,
                                                       num_head_draft_tokens=k))
    engine.prefill(seq)
    draft_times, verify_times = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        result = engine.verify(seq, seq.own_draft())  # the head's next draft is made inside the step
        draft_times.append(result.head_draft_seconds)
        verify_times.append(time.perf_counter() - started - result.head_draft_seconds)
    draft, verify = statistics.median(draft_times), statistics.median(verify_times)
    return {**_shape(k, drafter.tree), "draft_ms": round(draft * 1e3, 2), "verify_step_ms": round(verify * 1e3, 2),
            "draft_share": round(draft / verify, 3)}


def batch_cost(runner, drafter, context: int, k: int, batch: int, repeats: int, temperature: float = 0.0) -> dict:
    """Median seconds of `batch` sequences' head drafts of k tokens made together
    (one head step for all) and one after another, from the same head states:
    each repeat runs a plain step of every sequence, copies the heads' states,
    and drafts the two ways in alternating order, greedy or sampled at `temperature`."""
    from verifier_service.heads.drafting import DraftRequest
    from verifier_service.sequence import Draft, GenerationParams

    engine = _engine(runner, drafter, batch * (context + repeats + 2 + 64))
    params = GenerationParams(max_new_tokens=repeats + 2, ignore_eos=True, num_head_draft_tokens=k,
                              head_draft_on_demand=True)  # the engine leaves the drafting to this function
    seqs = [engine.open(f"batch{b}", [(i * 7919 + b * 104729) % (runner.vocab_size - 200) + 100
                                      for i in range(context)], params) for b in range(batch)]
    times: dict[str, list[float]] = {"together": [], "apart": []}
    for repeat in range(repeats + 1):  # the first step is the prefill
        engine.run_together([(seq, Draft()) for seq in seqs])
        with torch.inference_mode():
            states = {"together": [seq.head for seq in seqs], "apart": copy.deepcopy([seq.head for seq in seqs])}
        for way in (("together", "apart") if repeat % 2 else ("apart", "together")):
            started = time.perf_counter()
            requests = [DraftRequest(state, k, temperature or None, torch.Generator().manual_seed(i))
                        for i, state in enumerate(states[way])]
            if way == "together":
                drafter.draft_many(requests)
            else:
                for request in requests:
                    drafter.draft_many([request])
            if repeat:
                times[way].append(time.perf_counter() - started)
    together, apart = statistics.median(times["together"]), statistics.median(times["apart"])
    return {**_shape(k, drafter.tree), "sequences": batch, "temperature": temperature,
            "together_ms": round(together * 1e3, 2),
            "apart_ms": round(apart * 1e3, 2), "together_share": round(together / apart, 3)}


def acceptance(runner, drafter, prompts: list[list[int]], shapes: list[tuple[int, object]], max_tokens: int,
               token_cost: float) -> list[dict]:
    """Plain decoding, then each (k, tree shape or None for a chain)."""
    from verifier_service.sequence import Draft, GenerationParams

    rows = []
    for k, tree in [(0, None), *shapes]:
        drafter.tree = tree
        engine = _engine(runner, drafter if k else None, 16384)
        engine.draft_token_costs = {1: token_cost}
        steps = tokens = 0
        started = time.perf_counter()
        for prompt in prompts:
            seq = engine.open("bench", prompt, GenerationParams(max_new_tokens=max_tokens, num_head_draft_tokens=k))
            engine.prefill(seq)
            while not seq.finished:
                tokens += len(engine.verify(seq, seq.own_draft() if k else Draft()).token_ids)
                steps += 1
            engine.close(seq)
        rows.append({**_shape(k, tree), "tokens_per_step": round(tokens / steps, 3),
                     "ms_per_token": round((time.perf_counter() - started) / tokens * 1e3, 2)})
    plain = rows[0]["ms_per_token"]
    for row in rows:
        row["speedup"] = round(plain / row["ms_per_token"], 3)
    return rows


def _shape(k: int, tree) -> dict:
    return {"k": k, "topk": tree.topk if tree else 1, "max_nodes": tree.max_nodes if tree else k}


def _tree_shapes(args) -> list[tuple[int, object]]:
    """(k, tree shape or None for a chain) for each width and k, as the speculative config would make them."""
    from verifier_service.config import tree_shape

    nodes = {"num_draft_tokens": args.num_draft_tokens} if args.num_draft_tokens else {}
    return [(k, tree_shape({"eagle_topk": topk, "num_speculative_tokens": k, **nodes}))
            for topk in (int(t) for t in args.eagle_topk.split(",")) for k in (int(k) for k in args.k.split(","))]


def _measured_costs(runner, drafter, shapes, args) -> tuple[list[dict], list[dict]]:
    """The draft's cost next to a verify step, and, for each --batch size above 1, drafting a batch together."""
    costs, batches = [], []
    for k, tree in shapes:
        drafter.tree = tree
        costs.append(draft_cost(runner, drafter, args.context, k, args.repeats))
        batches += [batch_cost(runner, drafter, args.context, k, int(b), args.repeats, args.temperature)
                    for b in args.batch.split(",") if int(b) > 1]
    return costs, batches


def run(args) -> int:
    from transformers import AutoTokenizer

    from speclane_cli.bench.workloads import sharegpt
    from verifier_service.device import resolve_head_precision
    from verifier_service.draft_cost import measure_token_cost
    from verifier_service.heads.loading import load_head
    from verifier_service.model_runner import ModelRunner

    torch.set_num_threads(1)
    model_dir = str(resolve_model(args.model))
    runner = ModelRunner(model_dir, "cpu", torch.float32)
    precision = resolve_head_precision(args.head_dtype, "cpu", torch.float32)
    drafter = load_head(args.method, args.head, runner, precision)
    token_cost = (measure_token_cost(_engine(runner, None, 4096)) if args.token_cost == "auto"
                  else float(args.token_cost))
    shapes = _tree_shapes(args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c.turns[0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for c in sharegpt(args.num_prompts, 0, 1)]
    costs, batches = _measured_costs(runner, drafter, shapes, args)
    results = {"method": args.method, "head": args.head or "default", "token_cost": token_cost,
               "head_dtype": precision.name,
               "cost": costs, "batch_cost": batches,
               "acceptance": acceptance(runner, drafter, prompts, shapes, args.max_tokens, token_cost)}
    print("| k | topk | nodes | head draft (ms) | verify step (ms) | draft / step |\n|---|---|---|---|---|---|")
    for row in results["cost"]:
        print(f"| {row['k']} | {row['topk']} | {row['max_nodes']} | {row['draft_ms']} | {row['verify_step_ms']} "
              f"| {row['draft_share']:.1%} |")
    if batches:
        print("\n| k | topk | nodes | sequences | drafted together (ms) | one after another (ms) | together / apart |"
              "\n|---|---|---|---|---|---|---|")
    for row in batches:
        print(f"| {row['k']} | {row['topk']} | {row['max_nodes']} | {row['sequences']} | {row['together_ms']} "
              f"| {row['apart_ms']} | {row['together_share']:.2f} |")
    print("\n| k | topk | nodes | tokens per verify step | ms per token | speed-up vs k=0 |\n|---|---|---|---|---|---|")
    for row in results["acceptance"]:
        print(f"| {row['k']} | {row['topk']} | {row['max_nodes']} | {row['tokens_per_step']} | {row['ms_per_token']} "
              f"| {row['speedup']:.2f}x |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0
