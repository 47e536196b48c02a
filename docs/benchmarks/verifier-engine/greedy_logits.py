"""Greedy passes with the logits kept in the model's dtype and each row's argmax taken by our kernel
(csrc/greedy.cc) against the way before: the whole pass's logits widened to fp32, then torch.max's indices. One
process, bf16, the two ways alternated round by round on the same sequences (600 tokens of context), each pass
the fastest of 4, each way the best of 4 rounds (ms). Both cores.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/greedy_logits.py \
        [--model smollm2-135m-instruct]
"""

import argparse
import time
from unittest import mock

import torch

from speclane.models import resolve_model
from verifier_service import engine as engine_module
from verifier_service.block_manager import BlockManager
from verifier_service.device import set_threads
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams

CASES = ((1, 0), (1, 8), (16, 0), (16, 4), (32, 0))  # (sequences, draft tokens each)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    set_threads(0)
    runner = ModelRunner(str(resolve_model(args.model)), "cpu", torch.bfloat16)
    engine = Engine(runner, BlockManager(20_000, 16, False))
    params = GenerationParams(max_new_tokens=100_000, ignore_eos=True)
    run = ModelRunner.run

    def widened(self, plan):
        logits, features = run(self, plan)
        return logits.float(), features

    def before():  # the whole pass widened, then torch's reduction
        return mock.patch.multiple(ModelRunner, run=widened), mock.patch.object(
            engine_module, "greedy_choices", lambda logits: logits.max(dim=-1).indices)

    print("| sequences | draft tokens each | before ms | after ms | after / before |\n|--:|--:|--:|--:|--:|")
    for count, k in CASES:
        seqs = [engine.open(f"{count}-{k}-{i}", [(j * 7919 + i * 31) % runner.vocab_size for j in range(600)],
                            params) for i in range(count)]
        engine.run_together([(seq, Draft()) for seq in seqs])
        draft = Draft(token_ids=(5,) * k)
        best = {"before": float("inf"), "after": float("inf")}
        for _ in range(args.rounds):
            for way in best:
                patches = before() if way == "before" else ()
                for patch in patches:
                    patch.start()
                try:
                    for _ in range(4):
                        started = time.perf_counter()
                        engine.run_together([(seq, draft) for seq in seqs])
                        best[way] = min(best[way], time.perf_counter() - started)
                finally:
                    for patch in patches:
                        patch.stop()
        print(f"| {count} | {k} | {best['before'] * 1e3:.1f} | {best['after'] * 1e3:.1f} | "
              f"{best['after'] / best['before']:.3f} |", flush=True)
        for seq in seqs:
            engine.close(seq)


if __name__ == "__main__":
    main()
