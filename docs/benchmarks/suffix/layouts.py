"""Verify step times by draft length on one loaded model, one thread: the
linear layers' ways as the verifier measures them now (in sweeps over the whole
model, four ways including oneDNN's reordered weight) against how it measured
them before (each weight timed alone after writing 64 MB to evict it, three
ways), alternated in rounds. One sequence at 500 tokens of context, and 16
sequences at 300. Run from the repository root:
`python docs/benchmarks/suffix/layouts.py`."""

import statistics
import time

import torch

from speclane.models import resolve_model
from verifier_service.block_manager import BlockManager
from verifier_service.cpu_linear import MEASURED_ROWS, WAYS, MeasuredLinear, by_reordered, competes, fastest_ways
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams

DRAFT_LENGTHS = (0, 1, 2, 3, 4, 8, 16)
BATCH_DRAFT_LENGTHS = (0, 1, 4)
ROUNDS, REPEATS = 3, 7


def step_ms(runner: ModelRunner, k: int, sequences: int, context: int) -> float:
    """Median time of a verify step of `sequences` sequences with k draft tokens each."""
    engine = Engine(runner, BlockManager(16384 // 16, 16, False))
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


def alone_seconds(linear: MeasuredLinear, scratch: torch.Tensor) -> list[list[float]]:
    """The earlier measurement: this weight alone, best of 3 after writing
    `scratch`, by the three ways before oneDNN's."""
    seconds = []
    with torch.inference_mode():
        for rows in MEASURED_ROWS:
            x = torch.randn(rows, linear.in_features)
            times = []
            for way in WAYS:
                best = float("inf")
                if way is not by_reordered and competes(way, rows):
                    way(x, linear)
                    for _ in range(3):
                        scratch.add_(1)
                        started = time.perf_counter()
                        way(x, linear)
                        best = min(best, time.perf_counter() - started)
                times.append(best)
            seconds.append(times)
    return seconds


def main() -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(str(resolve_model("smollm2-135m-instruct")), "cpu", torch.float32)
    modules = [m for m in runner.model.modules() if isinstance(m, MeasuredLinear)]
    now = [m.ways for m in modules]
    scratch = torch.zeros(64 << 18)
    before_by_shape = {}
    for module in modules:
        shape = tuple(module.weight.shape)
        if shape not in before_by_shape:
            module.hold_layouts(range(len(WAYS)))
            before_by_shape[shape] = fastest_ways(alone_seconds(module, scratch))
    choices = {"in sweeps, four ways (now)": now,
               "alone, three ways (before)": [before_by_shape[tuple(m.weight.shape)] for m in modules]}
    for name, ways in choices.items():
        print(name, {tuple(m.weight.shape): w for m, w in zip(modules, ways)})
    cases = [(k, 1, 500) for k in DRAFT_LENGTHS] + [(k, 16, 300) for k in BATCH_DRAFT_LENGTHS]
    times: dict[tuple[str, tuple], list[float]] = {}
    for _ in range(ROUNDS):
        for name, ways in choices.items():
            for module, module_ways in zip(modules, ways):
                module.use(module_ways)
            for case in cases:
                times.setdefault((name, case), []).append(step_ms(runner, *case))
    print("| ways | " + " | ".join(f"{s} x {k}" for k, s, _ in cases) + " |")
    for name in choices:
        print(f"| {name} | " + " | ".join(f"{statistics.mean(times[(name, case)]):.1f}" for case in cases) + " |")


if __name__ == "__main__":
    main()
