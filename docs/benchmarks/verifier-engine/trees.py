"""What the A/B scripts here share: two source trees from the command line, each round's order of them (reversed
every other round, so neither always runs first), and a child run of a script inside one tree."""

import argparse
import os
import subprocess
import sys


def parse_trees() -> tuple[dict[str, str], int]:
    """({"before": path, "after": path}, rounds) from the command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    return {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}, args.rounds


def in_order(trees: dict[str, str], round_: int) -> list[tuple[str, str]]:
    return list(trees.items()) if round_ % 2 == 0 else list(reversed(trees.items()))


def run_in(tree: str, argv: list[str], env: dict | None = None) -> str:
    """The stdout of `python argv...` run with `tree` as its working directory and import path."""
    return subprocess.run([sys.executable, *argv], cwd=tree, env={**(env or os.environ), "PYTHONPATH": tree},
                          capture_output=True, text=True, check=True).stdout
