"""A pass with the fused Llama-form layers (verifier_service/fused_layer.py) against transformers' layer forward,
in process: both engines loaded side by side, rounds alternated, the best round of each. Contexts of 300 tokens;
one sequence decoding or verifying a 3-token chain, and 8 and 32 sequences decoding. Both cores.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/fused_layers.py \
        [--model smollm2-135m-instruct]
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
CASES = ((1, 0), (1, 3), (8, 0), (32, 0))  # (sequences, draft tokens each)


def engine(model: str, fused: bool) -> Engine:
    with mock.patch("verifier_service.model_runner.fuses_layers", lambda *_: fused):
        runner = ModelRunner(str(resolve_model(model)), "cpu", torch.float32)
    return Engine(runner, BlockManager(60_000 // 16, 16, True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="passes a round")
    args = parser.parse_args()
    set_threads(0)
    engines = {"transformers' layers": engine(args.model, False), "fused layers": engine(args.model, True)}
    params = GenerationParams(max_new_tokens=100_000, ignore_eos=True)
    print(f"| sequences | draft tokens each | {' ms | '.join(engines)} ms | fused / transformers' |")
    print("|--:|--:|--:|--:|--:|")
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
        before, after = best.values()
        print(f"| {sequences} | {draft} | {before * 1e3:.2f} | {after * 1e3:.2f} | {after / before:.3f} |", flush=True)


if __name__ == "__main__":
    main()
