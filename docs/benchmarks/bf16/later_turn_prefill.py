"""What a later turn's prefill costs by its new tokens: a prompt whose first 512 tokens the prefix cache holds,
then N new ones, through the verifier's engine (the fastest of 3), against prompts with nothing cached. Both cores.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/bf16/later_turn_prefill.py \
        --model qwen2.5-coder-0.5b-instruct --dtype bfloat16
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

CACHED = 512


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new", default="1,16,64,128,256,512", help="new tokens after the cached ones")
    args = parser.parse_args()
    set_threads(0)
    runner = ModelRunner(str(resolve_model(args.model)), "cpu", getattr(torch, args.dtype))
    engine = Engine(runner, BlockManager(200_000 // 16, 16, True))
    params = GenerationParams(max_new_tokens=1, ignore_eos=True)
    vocab = runner.vocab_size - 1000
    cached = [(j * 7919) % vocab for j in range(CACHED)]

    def prefill(name: str, tokens: list[int]) -> float:
        seq = engine.open(name, tokens, params)
        started = time.perf_counter()
        engine.run_together([(seq, Draft())])
        took = time.perf_counter() - started
        engine.close(seq)
        return took

    prefill("warm-up", cached + [1] * 64)  # also leaves the cached prefix in the cache
    for new in map(int, args.new.split(",")):
        best = min(prefill(f"{new}-{r}", cached + [(new * 13 + r * 101 + j) % vocab for j in range(new)])
                   for r in range(3))
        cold = prefill(f"cold-{new}", [(j * 31 + new) % vocab for j in range(CACHED + new)])
        print(f"{CACHED} cached + {new} new: {best * 1e3:.1f} ms; all {CACHED + new} uncached: {cold * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
