"""Would tree drafts raise suffix decoding's tokens a step at one sequence? SmolLM2's greedy replies (recorded once
with transformers, as `speclane bench policy` records them) replayed through the compiled suffix core, one request
after another (the global tree learning as at concurrency 1), each step's draft verified greedily: a chain accepts
its longest matching prefix, a tree its longest matching root path. Prints tokens and draft tokens a step, and the
decode speed in plain steps a token at several draft-token costs (a step costs 1 + cost x draft tokens).

    .venv/bin/python docs/benchmarks/vllm-cpu/tree_replay.py /tmp/bench-traces.json
"""

import json
import pathlib
import sys

from drafter_service import SuffixDecodingCache
from speclane.tokens import common_prefix
from speclane_cli.bench.policy import record

DATASETS = ["humaneval", "sharegpt", "code-edit"]
# (k, max_spec_factor, min_token_prob): the planner's budget at one sequence, and a larger one.
BUDGETS = ((24, 2.0, 0.1), (32, 4.0, 0.0))
COSTS = (0.038, 0.06, 0.1)  # 0.038: what the verifier measured a draft token at one sequence


def accepted(draft, rest: list[int], tree: bool) -> int:
    if not tree:
        return common_prefix(draft.token_ids, rest)
    depth, matched, best = {}, {}, 0
    for i, (token, parent) in enumerate(zip(draft.token_ids, draft.parents)):
        depth[i] = 0 if parent == -1 else depth[parent] + 1
        matched[i] = (parent == -1 or matched[parent]) and depth[i] < len(rest) and rest[depth[i]] == token
        best = max(best, depth[i] + 1) if matched[i] else best
    return best


def replay(traces: list, tree: bool, k: int, factor: float, min_prob: float) -> tuple[int, int, int]:
    cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=-1)
    tokens = steps = drafted = 0
    for number, (prompt, output) in enumerate(traces):
        cache.start_request(number, prompt)
        cache.add_active_response(number, output[:1])  # the prefill's token
        position = 1
        while position < len(output):
            draft = cache.speculate(number, prompt + output[:position], max_spec_tokens=k, max_spec_factor=factor,
                                    min_token_prob=min_prob, use_tree_spec=tree)
            committed = output[position:position + accepted(draft, output[position:], tree) + 1]
            cache.add_active_response(number, committed)
            position += len(committed)
            tokens, steps, drafted = tokens + len(committed), steps + 1, drafted + len(draft.token_ids)
        cache.stop_request(number)
    return tokens, steps, drafted


def main() -> None:
    path = pathlib.Path(sys.argv[1])
    if not path.exists():
        record(path, DATASETS, 12, 1, 128, 10)
    traces = json.loads(path.read_text())
    print("| data set | draft | k, factor, min prob | tokens/step | drafted/step | "
          + " | ".join(f"tokens per plain step at cost {cost}" for cost in COSTS) + " |")
    print("|---|---|---|--:|--:|" + "--:|" * len(COSTS))
    for name in DATASETS:
        for tree in (False, True):
            for k, factor, min_prob in BUDGETS:
                tokens, steps, drafted = replay(traces[name], tree, k, factor, min_prob)
                speeds = " | ".join(f"{tokens / (steps + drafted * cost):.2f}" for cost in COSTS)
                print(f"| {name} | {'tree' if tree else 'chain'} | {k}, {factor}, {min_prob} | {tokens / steps:.2f} | "
                      f"{drafted / steps:.1f} | {speeds} |")


if __name__ == "__main__":
    main()
