"""Why a step did or did not run on a next-round offer: code-edit replayed on the target's recorded replies as the
default stack drives it (suffix, k = 24, no global tree), through the drafter core and the gateway's own offer
code. Each step after a request's first is counted once, by what the step before it ended as.

usage: python docs/benchmarks/next-round/outcomes.py TRACES on|off   (TRACES from `speclane bench policy --traces`;
on|off: with or without detours)"""

import collections
import pathlib
import sys

from drafter_service.engine import DraftEngine
from drafter_service.service import draft_to_proto
from gateway.next_round import continuations_after, offered_draft, step_part
from speclane.speculation import SpeculationSettings
from speclane.tokens import common_prefix
from speclane_cli.bench.policy import load

K = 24


def why_missed(draft, offered, accepted: int, committed_len: int) -> str:
    if not draft.token_ids:
        return "no draft"
    at_outcome = [c for c in offered if c.draft.committed_len - committed_len - 1 == accepted]
    where = "accepted in full" if accepted == len(draft.token_ids) else (
        "rejected at its first token" if accepted == 0 else "rejected later")
    return f"{where}, {'other tokens offered there' if at_outcome else 'nothing offered there'}"


def main() -> None:
    traces, detours = load(pathlib.Path(sys.argv[1]))["code-edit"], sys.argv[2] == "on"
    engine = DraftEngine(64, 0)
    outcomes = collections.Counter()
    for trace in traces:
        out = trace.output
        seq_id = engine.start(trace.prompt, SpeculationSettings(method="suffix", num_speculative_tokens=K), "",
                              lookahead=K + 1)
        position, committed, offered, missed = 1, list(out[:1]), [], None
        while position < len(out):
            committed_len = len(trace.prompt) + position
            fresh = engine.core.step([seq_id], [committed])[0]
            drafted = draft_to_proto(fresh if detours else (*fresh[:7], []), committed_len)
            taken = offered_draft(offered, committed_len, committed[-1])
            if missed is not None:
                outcomes["ran on an offer" if taken is not None else missed] += 1
            draft = taken or step_part(drafted)
            offered = continuations_after(draft, drafted, K) if draft.token_ids else []
            accepted = common_prefix(draft.token_ids, out[position:])
            missed = why_missed(draft, offered, accepted, committed_len)
            committed = list(out[position:position + accepted + 1])
            position += len(committed)
        engine.end(seq_id)
    total = sum(outcomes.values())
    for outcome, count in outcomes.most_common():
        print(f"| {outcome} | {count} | {count / total:.1%} |")


if __name__ == "__main__":
    main()
