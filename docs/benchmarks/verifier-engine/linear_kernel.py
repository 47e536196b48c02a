"""SmolLM2-135M's linear products in a pass's order (30 layers of q, k, v, o, gate, up, down, then the vocabulary
projection; random fp32 weights of its shapes, 540 MB), each way of verifier_service/cpu_linear.py over the whole
sweep, at 1 to 8 rows; the host's threads. The ways alternate sweep by sweep; prints a markdown row per row count:
the best of 8 sweeps in ms, and the kernel against the fastest other way.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/linear_kernel.py
"""

import time

import torch
from torch import nn

from verifier_service.cpu_linear import WAYS, MeasuredLinear, by_kernel, competes

LAYERS = 30
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * LAYERS + [
    (49152, 576)]
ROWS = (1, 2, 3, 4, 6, 8)
SWEEPS = 8


def main() -> None:
    torch.manual_seed(0)
    linears = [MeasuredLinear(nn.Linear(n_in, n_out, bias=False)) for n_out, n_in in SHAPES]
    for linear in linears:
        linear.hold_layouts(range(len(WAYS)))
    names = [way.__name__ for way in WAYS]
    print(f"threads: {torch.get_num_threads()}\n")
    print(f"| rows | {' | '.join(names)} | kernel / fastest other |\n|{'---|' * (len(names) + 2)}")
    with torch.inference_mode():
        for rows in ROWS:
            inputs = {n_in: torch.randn(rows, n_in) for n_in in {linear.in_features for linear in linears}}
            ways = [way for way in WAYS if competes(way, rows)]
            best = {way: float("inf") for way in ways}
            for _ in range(SWEEPS):
                for way in ways:
                    started = time.perf_counter()
                    for linear in linears:
                        way(inputs[linear.in_features], linear)
                    best[way] = min(best[way], time.perf_counter() - started)
            others = min(seconds for way, seconds in best.items() if way is not by_kernel)
            cells = [f"{best[way] * 1e3:.1f}" if way in best else "" for way in WAYS]
            print(f"| {rows} | {' | '.join(cells)} | {best[by_kernel] / others:.2f}x |")


if __name__ == "__main__":
    main()
