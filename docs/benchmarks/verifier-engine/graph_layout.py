"""The host's part of a replayed pass that lays it out for its graph (graphs.py): FlexAttention's and Ascend's
`graph_inputs` for 1 and 64 sequences of about 2,000 tokens (blocks of 16, tables as wide as a 40,960-token
context), decodes and chains of 3 draft tokens. Two source trees side by side, a child process per tree and round,
the trees alternated; prints a markdown row per case with each tree's median ms.

    git worktree add /tmp/before 8469c3f
    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/graph_layout.py /tmp/before .
"""

import json
import os
import statistics
import sys
import time

from trees import in_order, parse_trees, run_in  # beside this file

BLOCK, WIDTH, CONTEXT = 16, 40960 // 16, 2000
CASES = [(1, 0), (64, 0), (64, 3)]  # (sequences, draft tokens a sequence)


def child() -> None:
    from verifier_service.attention.ascend import AscendAttention
    from verifier_service.attention.flex import FlexAttention
    from verifier_service.batch import Segment, StepPlan
    from verifier_service.graphs import GraphSize

    def plan(sequences: int, drafted: int) -> StepPlan:
        segments = []
        for i in range(sequences):
            start = CONTEXT + 7 * i
            blocks = tuple(range(i * 300, i * 300 + (start + drafted + 1) // BLOCK + 1))
            segments.append(Segment(blocks, start, 1, tuple(range(-1, drafted - 1))))
        return StepPlan((), tuple(range(sum(seg.num_tokens for seg in segments))), tuple(segments))

    def timed(layout, the_plan, size) -> float:
        for _ in range(3):
            layout(the_plan, size, BLOCK, WIDTH, 0)
        started = time.perf_counter()
        for _ in range(50):
            layout(the_plan, size, BLOCK, WIDTH, 0)
        return (time.perf_counter() - started) / 50 * 1e3

    result = {}
    for sequences, drafted in CASES:
        the_plan = plan(sequences, drafted)
        tokens = the_plan.num_tokens
        result[f"{sequences},{drafted}"] = {
            "flex": timed(FlexAttention.graph_inputs, the_plan, GraphSize(tokens, tokens)),
            "ascend": timed(AscendAttention.graph_inputs, the_plan, GraphSize(tokens, sequences))}
    print(json.dumps(result))


def main() -> None:
    trees, rounds = parse_trees()
    times: dict = {}
    for r in range(rounds):
        for name, tree in in_order(trees, r):
            measured = json.loads(run_in(tree, [os.path.abspath(__file__), "--child"]).splitlines()[-1])
            for case, layouts in measured.items():
                for layout, ms in layouts.items():
                    times.setdefault((case, layout, name), []).append(ms)
    print("| layout | sequences | draft tokens | before ms | after ms | after / before |")
    print("|---|--:|--:|--:|--:|--:|")
    for layout in ("flex", "ascend"):
        for sequences, drafted in CASES:
            case = f"{sequences},{drafted}"
            before = statistics.median(times[(case, layout, "before")])
            after = statistics.median(times[(case, layout, "after")])
            print(f"| {layout} | {sequences} | {drafted} | {before:.2f} | {after:.2f} | {after / before:.2f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child()
    else:
        main()
