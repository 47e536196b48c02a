"""Verifier passes with and without the bf16 kernel of AVX512-BF16 hosts (bf16_linear.py), in one process: the model
loads once, then every linear layer the batch-invariant mode streamed is swapped between `StreamedLinear` and a
oneDNN `PaddedLinear` of its weights, alternating round by round; each pass is the fastest of 4 steps, each side
the best of its rounds (ms). Both cores. With `--four-by-four`, the other side is the kernel without its one tile of
every row for short passes (`wide_rows=0`) instead of oneDNN.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/bf16/streamed_passes.py \
        --model qwen2.5-coder-0.5b-instruct
"""

import argparse
import time
from types import SimpleNamespace

import torch

from speclane.models import resolve_model
from verifier_service.batch_invariant import PaddedLinear
from verifier_service.bf16_linear import WIDE_ROWS, StreamedLinear, unpack
from verifier_service.block_manager import BlockManager
from verifier_service.device import set_threads
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--sequences", default="1,4,16")
    parser.add_argument("--k", default="0,4,8", help="draft tokens per sequence")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--four-by-four", action="store_true",
                        help="compare with the kernel's tiles of 4 x 4 only (no one tile of every row)")
    args = parser.parse_args()
    set_threads(0)
    runner = ModelRunner(str(resolve_model(args.model)), "cpu", torch.bfloat16)
    engine = Engine(runner, BlockManager(200_000 // 16, 16, False))
    streamed = [(parent, name, child) for parent in runner.model.modules()
                for name, child in parent.named_children() if isinstance(child, StreamedLinear)]
    if not streamed:
        raise SystemExit("no layer is streamed: this host has no AVX512-BF16")

    other = "4 x 4 tiles only" if args.four_by_four else "oneDNN"
    # oneDNN's padded products of the same weights, unpacked (the layers keep only their packed copies).
    onednn = {id(child): PaddedLinear(SimpleNamespace(
        in_features=child.in_features, out_features=child.out_features, bias=child.bias,
        weight=unpack(child.packed)), 2)
        for _, _, child in streamed}

    def use_kernel(kernel: bool) -> None:
        for parent, name, child in streamed:
            if args.four_by_four:
                child.wide_rows = WIDE_ROWS if kernel else 0
            else:
                setattr(parent, name, child if kernel else onednn[id(child)])

    params = GenerationParams(max_new_tokens=100_000, ignore_eos=True)
    print(f"{len(streamed)} layers streamed\n\n| sequences | k | kernel | {other} | kernel / {other} |\n"
          "|---|---|---|---|---|")
    for count in map(int, args.sequences.split(",")):
        seqs = [engine.open(f"{count}-{i}", [(j * 7919 + i * 31) % runner.vocab_size for j in range(args.context)],
                            params) for i in range(count)]
        engine.run_together([(seq, Draft()) for seq in seqs])
        for k in map(int, args.k.split(",")):
            draft = Draft(token_ids=(5,) * k)
            best = {True: float("inf"), False: float("inf")}
            for _ in range(args.rounds):
                for kernel in best:
                    use_kernel(kernel)
                    for _ in range(4):
                        started = time.perf_counter()
                        engine.run_together([(seq, draft) for seq in seqs])
                        best[kernel] = min(best[kernel], time.perf_counter() - started)
            use_kernel(True)
            print(f"| {count} | {k} | {best[True] * 1e3:.1f} | {best[False] * 1e3:.1f} | "
                  f"{best[True] / best[False]:.2f}x |")
        for seq in seqs:
            engine.close(seq)


if __name__ == "__main__":
    main()
