"""Hybrid speculation's choice, each step, between the drafter's draft and
the verifier head's. The head drafts on demand (Prefill.head_draft_on_demand):
only for the steps that verify its draft, so the choice is made before the
head's draft exists, from what the head's drafts have been worth: in the
request so far, starting from what they have been worth on all traffic. A head
draft costs about a tenth of a verify step on a CPU at k = 4; drafting one
after every step, as a pure head method does, spends that also on the steps
the drafter wins (most of them on code and agent loops)."""

from dataclasses import dataclass

from protos.common.v1 import common_pb2
from speclane.speculation import draft_value

# How much one head step moves a request's estimate (a few steps follow a change
# of topic, one lucky step does not decide the rest) and the server's.
REQUEST_WEIGHT = 0.25
SERVER_WEIGHT = 0.02


def head_step_worth(result, token_cost: float) -> float:
    """What a step that verified the head's draft committed per unit of step
    time (a verifier's SessionResponse): its verification, plus the head's
    drafting in plain steps, read off the pass (its time over its cost). The
    head's draft is a tenth to a quarter of a step on a CPU, so leaving it out
    would send steps to the head that a drafter draft does better; the
    drafter's answer, a millisecond, is small enough to leave out."""
    verify_cost = 1.0 + token_cost * result.num_draft_tokens
    drafting = result.head_draft_seconds / result.forward_seconds * verify_cost if result.forward_seconds > 0 else 0.0
    return draft_value(result.num_accepted_draft_tokens, result.num_draft_tokens, token_cost, drafting)


@dataclass
class HeadWorth:
    """What a step verifying the head's draft commits per unit of step time
    (head_step_worth), as a running average. It
    starts at a plain step's worth, 1: until the head has shown what it is
    worth, a drafter draft that pays for its own verification is taken."""

    weight: float
    worth: float = 1.0

    def observe(self, worth: float) -> None:
        self.worth += self.weight * (worth - self.worth)


@dataclass
class HybridChoice:
    token_cost: float
    head: HeadWorth  # this request's

    def prefers_head(self, drafted: common_pb2.Draft) -> bool:
        """Whether the head's draft is expected to commit more per unit of verify
        time than `drafted` (whose score is its expected accepted tokens)."""
        n = len(drafted.token_ids)
        return not n or draft_value(drafted.score, n, self.token_cost) < self.head.worth

