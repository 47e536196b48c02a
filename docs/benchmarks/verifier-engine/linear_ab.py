"""The linear kernel of two source trees side by side: SmolLM2-135M's 211 products in a pass's order (random
fp32 weights of its shapes, 540 MB, the shapes of linear_kernel.py) through `by_kernel` at 1 to 10 rows, the
host's threads, a child process per tree and round, the trees alternated. Prints a markdown row per row count:
each round's best-of-8 sweep in ms, the medians and after / before.

    git worktree add /tmp/before <commit>    # then build its extension: python setup.py build_ext --inplace
    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/linear_ab.py /tmp/before .
"""

import json
import os
import statistics
import sys
import time

from trees import in_order, parse_trees, run_in  # beside this file

ROWS = (1, 2, 3, 4, 5, 6, 8, 10)
SWEEPS = 8


def main() -> None:
    trees, rounds = parse_trees()
    times = {(rows, name): [] for rows in ROWS for name in trees}
    for r in range(rounds):
        for name, tree in in_order(trees, r):
            for rows, ms in json.loads(run_in(tree, [os.path.abspath(__file__), "--child"])).items():
                times[int(rows), name].append(ms)
    print("| rows | before, each round (ms) | after, each round (ms) | before | after | after / before |")
    print("|---|---|---|---|---|---|")
    for rows in ROWS:
        before, after = times[rows, "before"], times[rows, "after"]
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {rows} | {' / '.join(f'{v:.1f}' for v in before)} | {' / '.join(f'{v:.1f}' for v in after)} "
              f"| {b:.1f} | {a:.1f} | {a / b:.3f} |")


def child() -> None:
    """{rows: the best sweep's ms} for the tree on the import path."""
    import torch
    from linear_kernel import SHAPES  # beside this file
    from torch import nn

    from verifier_service.cpu_linear import MeasuredLinear, by_kernel

    torch.manual_seed(0)
    linears = [MeasuredLinear(nn.Linear(n_in, n_out, bias=False)) for n_out, n_in in SHAPES]
    best = {}
    with torch.inference_mode():
        for rows in ROWS:
            inputs = {n_in: torch.randn(rows, n_in) for n_in in {linear.in_features for linear in linears}}
            best[rows] = float("inf")
            for _ in range(SWEEPS):
                started = time.perf_counter()
                for linear in linears:
                    by_kernel(inputs[linear.in_features], linear)
                best[rows] = min(best[rows], (time.perf_counter() - started) * 1e3)
    print(json.dumps(best))


if __name__ == "__main__":
    child() if sys.argv[1:2] == ["--child"] else main()
