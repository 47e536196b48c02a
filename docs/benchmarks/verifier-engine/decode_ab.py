"""SmolLM2-135M's decode step, the engine in process, with two source trees side by side: a child process per
measurement (tcmalloc preloaded, as the verifier does; a 4 GiB cache, as it serves by default; contexts of 300
to 300 + 7 x (sequences - 1) tokens), the trees alternated in rounds. Also one sequence verifying chains of 3
and 6 draft tokens. Prints a markdown row per case: each round's step ms, the medians and after / before.

    git worktree add /tmp/before <commit>
    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/decode_ab.py /tmp/before .
"""

import ctypes.util
import os
import re
import statistics
import sys

from trees import in_order, parse_trees, run_in  # beside this file

MODEL = os.path.expanduser("~/.cache/speclane/models/smollm2-135m-instruct")
CASES = {(1, 0): 150, (1, 3): 100, (1, 6): 80, (32, 0): 40, (64, 0): 25}  # (sequences, draft tokens) -> steps
CACHE_BYTES = 4 << 30


def main() -> None:
    trees, rounds = parse_trees()
    env = {**os.environ, "LD_PRELOAD": ctypes.util.find_library("tcmalloc_minimal") or ""}
    times = {(case, name): [] for case in CASES for name in trees}
    for r in range(rounds):
        for (size, drafted), steps in CASES.items():
            for name, tree in in_order(trees, r):
                out = run_in(tree, [os.path.abspath(__file__), "--child", str(size), str(steps), str(drafted)], env)
                times[(size, drafted), name].append(float(re.search(r"step_ms ([\d.]+)", out)[1]))
    print("| sequences | draft tokens | before, each round | after, each round | before ms | after ms "
          "| after / before |")
    print("|---|---|---|---|---|---|---|")
    for size, drafted in CASES:
        before, after = times[(size, drafted), "before"], times[(size, drafted), "after"]
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {size} | {drafted} | {' / '.join(f'{v:.1f}' for v in before)} | "
              f"{' / '.join(f'{v:.1f}' for v in after)} | {b:.1f} | {a:.1f} | {a / b:.3f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        from allocator import decode_step_ms  # beside this file; the tree measured comes from PYTHONPATH

        size, steps, drafted = map(int, sys.argv[2:5])
        print(f"step_ms {decode_step_ms(size, steps, CACHE_BYTES, 7, drafted):.2f}")
    else:
        main()
