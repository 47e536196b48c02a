"""Hybrid's choice between the drafter's draft and the head's, made before the head drafts."""

import pytest

from gateway.hybrid import HeadWorth, HybridChoice, head_step_worth
from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2
from speclane.speculation import draft_value


def draft(length: int, score: float) -> common_pb2.Draft:
    return common_pb2.Draft(token_ids=list(range(length)), score=score)


def test_until_the_head_has_drafted_a_drafter_draft_that_pays_for_its_verification_is_taken():
    choice = HybridChoice(token_cost=0.2, head=HeadWorth(weight=0.25))
    assert not choice.prefers_head(draft(1, score=0.3))  # (1 + 0.3) / 1.2 > a plain step
    assert choice.prefers_head(draft(1, score=0.1))  # (1 + 0.1) / 1.2 < a plain step
    assert choice.prefers_head(draft(0, score=0.0))


def test_the_heads_worth_follows_what_its_drafts_commit():
    head = HeadWorth(weight=0.25)
    choice = HybridChoice(token_cost=0.2, head=head)
    drafted = draft(4, score=1.2)  # worth (1 + 1.2) / 1.8 = 1.22
    assert not choice.prefers_head(drafted)
    for _ in range(8):  # 2 of 2 head tokens accepted a step
        head.observe(draft_value(2, 2, 0.2))
    assert head.worth == pytest.approx(3 / 1.4, abs=0.25)
    assert choice.prefers_head(drafted)
    for _ in range(8):  # none accepted
        head.observe(draft_value(0, 2, 0.2))
    assert not choice.prefers_head(drafted)


def test_a_head_steps_worth_counts_the_heads_drafting_in_plain_steps():
    # Two of two draft tokens accepted, each costing 0.2 of a plain step: a pass of 1.4 plain
    # steps took 70 ms, so a plain step is 50 ms and the head's 10 ms of drafting is 0.2 more.
    step = verifier_pb2.SessionResponse(num_draft_tokens=2, num_accepted_draft_tokens=2, forward_seconds=0.07,
                                        head_draft_seconds=0.01)
    assert head_step_worth(step, token_cost=0.2) == pytest.approx(3 / 1.6)
    assert head_step_worth(step, token_cost=0.2) < draft_value(2, 2, 0.2)
    # An answer without timings (an older verifier) is judged by its verification alone.
    untimed = verifier_pb2.SessionResponse(num_draft_tokens=2, num_accepted_draft_tokens=2)
    assert head_step_worth(untimed, token_cost=0.2) == pytest.approx(draft_value(2, 2, 0.2))
