"""Verify step times by draft length on one loaded model, one thread: the
linear layers' ways as the verifier times them at load (three ways: F.linear,
x @ W_t, W @ x^T) against the two layouts it timed before (F.linear, x @ W_t),
alternated in rounds. One sequence at 500 tokens of context, and 16 sequences
at 300. Run from the repository root: `python docs/bench/suffix/layouts.py`."""

import statistics
import time

import torch
from torch import nn

from speclane.models import resolve_model
from verifier_service.cpu_linear import WAYS, MeasuredLinear, by_linear, by_transposed, fastest_ways, way_seconds
from verifier_service.engine import Engine
from verifier_service.kv_pool import KVPool
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams

DRAFT_LENGTHS = (0, 1, 2, 3, 4, 8, 16)
BATCH_DRAFT_LENGTHS = (0, 1, 4)
ROUNDS, REPEATS = 3, 7


def step_ms(runner: ModelRunner, k: int, sequences: int, context: int) -> float:
    """Median time of a verify step of `sequences` sequences with k draft tokens each."""
    engine = Engine(runner, KVPool(16384, 64, False))
    seqs = []
    for s in range(sequences):
        prompt = [(i * 7919 + s) % 49000 + 100 for i in range(context)]
        seqs.append(engine.open(f"s{s}", prompt, GenerationParams(max_new_tokens=400, ignore_eos=True)))
        engine.prefill(seqs[-1])
    times = []
    for _ in range(REPEATS):
        done = []
        for seq in seqs:
            engine.submit(seq, Draft(tuple([5] * k), committed_len=len(seq.tokens)), done.append)
        started = time.perf_counter()
        while len(done) < len(seqs):
            engine.step()
        times.append(time.perf_counter() - started)
    for seq in seqs:
        engine.close(seq)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(str(resolve_model("smollm2-135m-instruct")), "cpu", torch.float32)
    modules = [m for m in runner.model.modules() if isinstance(m, MeasuredLinear)]
    scratch = torch.zeros(64 << 18)
    seconds = {}
    for module in modules:
        if module.weight_t is None:
            module.weight_t = nn.Parameter(module.weight.detach().t().contiguous(), requires_grad=False)
        shape = tuple(module.weight.shape)
        if shape not in seconds:
            seconds[shape] = way_seconds(module.weight.detach(), module.weight_t.detach(), scratch)
    two_layouts = tuple(WAYS.index(way) for way in (by_linear, by_transposed))
    choices = {"three ways (now)": [fastest_ways(seconds[tuple(m.weight.shape)]) for m in modules],
               "two layouts (before)": [fastest_ways(seconds[tuple(m.weight.shape)], two_layouts) for m in modules]}
    for shape, per_rows in seconds.items():
        print(shape, [tuple(round(t * 1e6) for t in times) for times in per_rows])
    cases = [(k, 1, 500) for k in DRAFT_LENGTHS] + [(k, 16, 300) for k in BATCH_DRAFT_LENGTHS]
    times: dict[tuple[str, tuple], list[float]] = {}
    for _ in range(ROUNDS):
        for name, ways in choices.items():
            for module, module_ways in zip(modules, ways):
                module.ways = module_ways
            for case in cases:
                times.setdefault((name, case), []).append(step_ms(runner, *case))
    print("| ways | " + " | ".join(f"{s} x {k}" for k, s, _ in cases) + " |")
    for name in choices:
        print(f"| {name} | " + " | ".join(f"{statistics.mean(times[(name, case)]):.1f}" for case in cases) + " |")


if __name__ == "__main__":
    main()
