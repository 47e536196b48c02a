"""One sequence's verify step times at 500 tokens of context, on one loaded model,
with the linear layouts timed at load against the former fixed rule (the
transposed layout from 4 rows on). Run from the repository root:
`python docs/bench/suffix/layouts.py`."""

import statistics
import time

import torch

from speclane.models import resolve_model
from verifier_service.cpu_linear import MEASURED_ROWS, TwoLayoutLinear
from verifier_service.engine import Engine
from verifier_service.kv_pool import KVPool
from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Draft, GenerationParams

DRAFT_LENGTHS = (0, 1, 2, 3, 4, 8)
ROUNDS, REPEATS, CONTEXT = 3, 7, 500


def step_ms(runner: ModelRunner, k: int) -> float:
    engine = Engine(runner, KVPool(4096, 64, False))
    prompt = [(i * 7919) % 49000 + 100 for i in range(CONTEXT)]
    seq = engine.open("s", prompt, GenerationParams(max_new_tokens=400, ignore_eos=True))
    engine.prefill(seq)
    times = []
    for _ in range(REPEATS):
        draft = Draft(tuple([5] * k), committed_len=len(seq.tokens))
        started = time.perf_counter()
        engine.verify(seq, draft)
        times.append(time.perf_counter() - started)
    engine.close(seq)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(str(resolve_model("smollm2-135m-instruct")), "cpu", torch.float32)
    modules = [m for m in runner.model.modules() if isinstance(m, TwoLayoutLinear)]
    choices = {"timed at load": [m.wins for m in modules],
               "fixed rule": [tuple(rows >= 4 for rows in MEASURED_ROWS)] * len(modules)}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(ROUNDS):
        for name, wins in choices.items():
            for module, module_wins in zip(modules, wins):
                module.wins = module_wins
            for k in DRAFT_LENGTHS:
                times.setdefault((name, k), []).append(step_ms(runner, k))
    print("| draft tokens | " + " | ".join(map(str, DRAFT_LENGTHS)) + " |")
    for name in choices:
        print(f"| {name} | " + " | ".join(f"{statistics.mean(times[(name, k)]):.1f}" for k in DRAFT_LENGTHS) + " |")


if __name__ == "__main__":
    main()
