"""Verifier pass times by dtype: the engine's prefill of N prompts of CTX tokens,
then steps of every sequence with k draft tokens (the fastest of 4 each); one
thread unless --threads says otherwise (0: the host's cores).

    python docs/benchmarks/bf16/pass_times.py --dtype bfloat16 --sequences 16 --context 300 --k 0,1,4,8
"""

import argparse
import time

import torch

from speclane.models import DEFAULT_MODEL, resolve_model
from verifier_service.block_manager import BlockManager
from verifier_service.device import set_threads
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--k", default="0,1,3,8,24", help="draft lengths")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1, help="the README's first tables are one-thread numbers")
    args = parser.parse_args()
    set_threads(args.threads)
    runner = ModelRunner(str(resolve_model(args.model)), "cpu", getattr(torch, args.dtype),
                         batch_invariant=args.batch_invariant)
    engine = Engine(runner, BlockManager(200_000 // 16, 16, False))
    params = GenerationParams(max_new_tokens=100_000, ignore_eos=True)
    seqs = [engine.open(f"s{i}", [(j * 7919 + i * 31) % runner.vocab_size for j in range(args.context)], params)
            for i in range(args.sequences)]
    started = time.perf_counter()
    engine.run_together([(seq, Draft()) for seq in seqs])
    took = time.perf_counter() - started
    print(f"{args.dtype}, attention {runner.backend.name}: "
          f"prefill {args.sequences} x {args.context} tokens {took:.2f} s")
    for k in (int(x) for x in args.k.split(",")):
        draft = Draft(token_ids=(5,) * k)
        times = []
        for _ in range(4):
            started = time.perf_counter()
            engine.run_together([(seq, draft) for seq in seqs])
            times.append(time.perf_counter() - started)
        print(f"{args.dtype}: {args.sequences} sequences, k = {k}: {min(times) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
