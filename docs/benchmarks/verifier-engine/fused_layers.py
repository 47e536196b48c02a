"""A pass with the fused Llama-form layers (verifier_service/fused_layer.py) against transformers' layer forward,
in process: both engines loaded side by side, rounds alternated, the best round of each. Contexts of 300 tokens;
one sequence decoding or verifying a chain of 3 or 8 tokens, 8 and 32 sequences decoding, 8 verifying 4 each, and
the prefill of a 490-token prompt (fresh each round). Both cores; fp32 unless --dtype says bfloat16.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/fused_layers.py \
        [--model smollm2-135m-instruct] [--dtype bfloat16]
"""

import argparse
import time
from unittest import mock

import torch

from speclane.models import DEFAULT_MODEL, resolve_model
from verifier_service.block_manager import BlockManager
from verifier_service.device import set_threads
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams

CONTEXT = 300
CASES = ((1, 0), (1, 3), (1, 8), (8, 0), (8, 4), (32, 0))  # (sequences, draft tokens each)
PREFILL = 490


def engine(model: str, fused: bool, dtype: torch.dtype) -> Engine:
    with mock.patch("verifier_service.model_runner.fuses_layers", lambda *_: fused):
        runner = ModelRunner(str(resolve_model(model)), "cpu", dtype)
    return Engine(runner, BlockManager(60_000 // 16, 16, True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="passes a round")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    set_threads(0)
    dtype = getattr(torch, args.dtype)
    engines = {"transformers' layers": engine(args.model, False, dtype),
               "fused layers": engine(args.model, True, dtype)}
    params = GenerationParams(max_new_tokens=100_000, ignore_eos=True)
    print(f"| sequences | draft tokens each | {' ms | '.join(engines)} ms | fused / transformers' |")
    print("|--:|--:|--:|--:|--:|")
    best = dict.fromkeys(engines, float("inf"))
    for r in range(args.rounds):  # prompts no round has seen, so the prefix cache holds none of them
        for name, e in engines.items():
            seq = e.open(f"{name}-prefill-{r}", [(j * 7907 + r) % 40000 for j in range(PREFILL)], params)
            started = time.perf_counter()
            e.run_together([(seq, Draft())])
            best[name] = min(best[name], time.perf_counter() - started)
            e.close(seq)
    report(f"prefill of {PREFILL}", "-", best)
    for sequences, draft in CASES:
        live = {}
        for name, e in engines.items():
            live[name] = [e.open(f"{name}-{sequences}-{draft}-{i}",
                                 [(j * 7919 + i) % 40000 for j in range(CONTEXT)], params) for i in range(sequences)]
            e.run_together([(seq, Draft()) for seq in live[name]])  # the prompts
        best = dict.fromkeys(engines, float("inf"))
        for _ in range(args.rounds):
            for name, e in engines.items():
                started = time.perf_counter()
                for _ in range(args.steps):  # the same shape every pass, accepted or not
                    e.run_together([(seq, Draft(token_ids=(5,) * draft)) for seq in live[name]])
                best[name] = min(best[name], (time.perf_counter() - started) / args.steps)
        for name, e in engines.items():
            for seq in live[name]:
                e.close(seq)
        report(sequences, draft, best)


def report(sequences, draft, best: dict[str, float]) -> None:
    before, after = best.values()
    print(f"| {sequences} | {draft} | {before * 1e3:.2f} | {after * 1e3:.2f} | {after / before:.3f} |", flush=True)


if __name__ == "__main__":
    main()
