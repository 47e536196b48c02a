"""SmolLM2-135M's decode step, the engine in process, with two source trees side by side: a child process per
measurement (tcmalloc preloaded, as the verifier does; a 4 GiB cache, as it serves by default; contexts of 300
to 300 + 7 x (sequences - 1) tokens), the trees alternated in rounds. Prints a markdown row per batch size:
each round's step ms, the medians and after / before.

    git worktree add /tmp/before <commit>
    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/decode_ab.py /tmp/before .
"""

import argparse
import ctypes.util
import os
import re
import statistics
import subprocess
import sys

MODEL = os.path.expanduser("~/.cache/speclane/models/smollm2-135m-instruct")
SIZES = {1: 150, 32: 40, 64: 25}  # sequences -> decode steps timed
CACHE_BYTES = 4 << 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    env = {**os.environ, "LD_PRELOAD": ctypes.util.find_library("tcmalloc_minimal") or ""}
    times = {(size, name): [] for size in SIZES for name in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for size, steps in SIZES.items():
            for name, tree in order:
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(size), str(steps)],
                                      cwd=tree, env={**env, "PYTHONPATH": tree}, capture_output=True, text=True,
                                      check=True)
                times[size, name].append(float(re.search(r"step_ms ([\d.]+)", done.stdout)[1]))
    print("| sequences | before, each round | after, each round | before ms | after ms | after / before |")
    print("|---|---|---|---|---|---|")
    for size in SIZES:
        before, after = times[size, "before"], times[size, "after"]
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {size} | {' / '.join(f'{v:.1f}' for v in before)} | {' / '.join(f'{v:.1f}' for v in after)} "
              f"| {b:.1f} | {a:.1f} | {a / b:.3f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        from allocator import decode_step_ms  # beside this file; the tree measured comes from PYTHONPATH

        print(f"step_ms {decode_step_ms(int(sys.argv[2]), int(sys.argv[3]), CACHE_BYTES, 7):.2f}")
    else:
        main()
