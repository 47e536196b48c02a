"""What a step that no next-round offer foresaw would verify: the drafter's draft (after a round trip) against
the verifier's own prompt lookup (NextRound.lookup_tokens, at once). Replayed on the target's recorded greedy
replies as the default stack drives them (suffix, k = 24), through the drafter core and the gateway's offer code;
the verifier's lookup is its own function.

usage: python docs/benchmarks/next-round/misses.py TRACES DATASETS MAX_CACHED_REQUESTS
(TRACES from `speclane bench policy --traces`; MAX_CACHED_REQUESTS 0: no global tree, as the link runs before)"""

import collections
import pathlib
import sys

from drafter_service.engine import DraftEngine
from drafter_service.service import draft_to_proto
from gateway.next_round import continuations_after, offered_draft, step_part
from speclane.speculation import SpeculationSettings
from speclane.tokens import common_prefix
from speclane_cli.bench.policy import load
from verifier_service.prompt_lookup import lookup_draft

K = 24


def replay(traces, max_cached_requests: int) -> collections.Counter:
    engine = DraftEngine(64, max_cached_requests)
    counts = collections.Counter()
    for trace in traces:
        out = trace.output
        seq_id = engine.start(trace.prompt, SpeculationSettings(method="suffix", num_speculative_tokens=K), "",
                              lookahead=K + 1)
        position, committed, offered = 1, list(out[:1]), []
        while position < len(out):
            committed_len = len(trace.prompt) + position
            drafted = draft_to_proto(engine.core.step([seq_id], [committed])[0], committed_len)
            taken = offered_draft(offered, committed_len, committed[-1])
            step = step_part(drafted)
            if position > 1:  # the first step always waits for its Verify
                counts["steps"] += 1
                if taken is not None:
                    counts["ran on an offer"] += 1
                else:
                    looked_up = lookup_draft(list(trace.prompt) + list(out[:position]), K)
                    drafter_accepted = common_prefix(step.token_ids, out[position:])
                    lookup_accepted = common_prefix(looked_up, out[position:])
                    counts["missed"] += 1
                    counts["missed, same draft"] += looked_up == list(step.token_ids)
                    counts["drafter accepted"] += drafter_accepted
                    counts["lookup accepted"] += lookup_accepted
            draft = taken or step
            offered = continuations_after(draft, drafted, K) if draft.token_ids else []
            accepted = common_prefix(draft.token_ids, out[position:])
            committed = list(out[position:position + accepted + 1])
            position += len(committed)
        engine.end(seq_id)
    return counts


def main() -> None:
    traces = load(pathlib.Path(sys.argv[1]))
    print("| data set | steps | ran on an offer | missed | missed, same draft | accepted on the misses: drafter "
          "→ lookup |")
    print("|---|---|---|---|---|---|")
    for name in sys.argv[2].split(","):
        c = replay(traces[name], int(sys.argv[3]))
        print(f"| {name} | {c['steps']} | {c['ran on an offer']} | {c['missed']} | {c['missed, same draft']} | "
              f"{c['drafter accepted']} → {c['lookup accepted']} |")


if __name__ == "__main__":
    main()
