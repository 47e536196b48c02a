"""The step planner's estimates (gateway/estimates.py) and the cuts it makes with them (gateway/planner.py)."""

import pytest

from gateway.estimates import HeadWorth, MethodAcceptance, PositionCounts, RequestAcceptance, head_step_worth
from gateway.planner import EXPLORE_EVERY, Measurements, break_even_length, prefers_head
from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2
from speclane.speculation import draft_value


def worthwhile(request: RequestAcceptance, threshold: float, limit: int) -> int:
    return break_even_length(request.rates(limit), threshold, cut_steps=0)[0]


def test_counts_are_conditional_on_every_earlier_token_accepted():
    counts = PositionCounts()
    counts.observe(num_draft_tokens=5, num_accepted=2)  # positions 0, 1 accepted; 2 rejected; 3, 4 never reached
    counts.observe(num_draft_tokens=1, num_accepted=1)
    counts.observe(num_draft_tokens=0, num_accepted=0)
    assert (counts.reached, counts.accepted) == ([2, 1, 1], [2, 1, 0])
    assert counts.rate(2, prior=0.5, prior_steps=1.0) == pytest.approx(0.25)
    assert counts.rate(7, prior=0.5, prior_steps=1.0) == 0.5  # never reached: the prior


def test_a_request_whose_drafts_fail_gets_none_under_load_and_keeps_them_alone():
    request = RequestAcceptance(MethodAcceptance())
    assert worthwhile(request, 0.36, limit=8) == 8  # nothing known: every position explored
    for _ in range(6):
        request.observe(num_draft_tokens=8, num_accepted=1)  # the first token lands, the second never
    assert worthwhile(request, 0.17, limit=8) == 1
    assert worthwhile(request, 0.36, limit=8) == 1  # 6 of 6 first tokens: still pays
    for _ in range(10):
        request.observe(num_draft_tokens=1, num_accepted=0)
    assert worthwhile(request, 0.17, limit=8) == 1  # 6 in 16 first tokens land
    assert worthwhile(request, 0.5, limit=8) == 0


def test_a_request_with_every_draft_cut_still_tries_one_token_now_and_then():
    request = RequestAcceptance(MethodAcceptance())
    for _ in range(8):
        request.observe(num_draft_tokens=4, num_accepted=0)
    lengths, cut_steps = [], 0
    for _ in range(3 * EXPLORE_EVERY):
        length, cut_steps = break_even_length(request.rates(4), 0.5, cut_steps)
        lengths.append(length)
    assert lengths == ([0] * (EXPLORE_EVERY - 1) + [1]) * 3


def test_a_new_request_starts_from_what_its_method_has_seen():
    method = MethodAcceptance()
    for _ in range(20):
        RequestAcceptance(method).observe(num_draft_tokens=4, num_accepted=0)
    fresh = RequestAcceptance(method)
    assert worthwhile(fresh, 0.3, limit=4) == 0
    for _ in range(4):
        fresh.observe(num_draft_tokens=4, num_accepted=4)  # this one's drafts land: its own record wins
    assert worthwhile(fresh, 0.3, limit=4) == 4


# Hybrid's choice between the drafter's draft and the head's, made before the head drafts.

def draft(length: int, score: float) -> common_pb2.Draft:
    return common_pb2.Draft(token_ids=list(range(length)), score=score)


def hybrid(head: HeadWorth) -> Measurements:
    return Measurements(1, 0.2, 0.2, None, 0, head.worth, False)


def test_until_the_head_has_drafted_a_drafter_draft_that_pays_for_its_verification_is_taken():
    head = HeadWorth(weight=0.25)
    assert not prefers_head(draft(1, score=0.3), hybrid(head))  # (1 + 0.3) / 1.2 > a plain step
    assert prefers_head(draft(1, score=0.1), hybrid(head))  # (1 + 0.1) / 1.2 < a plain step
    assert prefers_head(draft(0, score=0.0), hybrid(head))


def test_the_heads_worth_follows_what_its_drafts_commit():
    head = HeadWorth(weight=0.25)
    drafted = draft(4, score=1.2)  # worth (1 + 1.2) / 1.8 = 1.22
    assert not prefers_head(drafted, hybrid(head))
    for _ in range(8):  # 2 of 2 head tokens accepted a step
        head.observe(draft_value(2, 2, 0.2))
    assert head.worth == pytest.approx(3 / 1.4, abs=0.25)
    assert prefers_head(drafted, hybrid(head))
    for _ in range(8):  # none accepted
        head.observe(draft_value(0, 2, 0.2))
    assert not prefers_head(drafted, hybrid(head))


def test_a_head_steps_worth_counts_the_heads_drafting_in_plain_steps():
    # Two of two draft tokens accepted, each costing 0.2 of a plain step: a pass of 1.4 plain
    # steps took 70 ms, so a plain step is 50 ms and the head's 10 ms of drafting is 0.2 more.
    step = verifier_pb2.SessionResponse(num_draft_tokens=2, num_accepted_draft_tokens=2, forward_seconds=0.07,
                                        head_draft_seconds=0.01)
    assert head_step_worth(step, token_cost=0.2) == pytest.approx(3 / 1.6)
    assert head_step_worth(step, token_cost=0.2) < draft_value(2, 2, 0.2)
    # An answer without timings (a prefill-less fake) is judged by its verification alone.
    untimed = verifier_pb2.SessionResponse(num_draft_tokens=2, num_accepted_draft_tokens=2)
    assert head_step_worth(untimed, token_cost=0.2) == pytest.approx(draft_value(2, 2, 0.2))


def test_drafter_scores_are_taken_at_what_its_drafts_have_accepted():
    method = MethodAcceptance()
    request = RequestAcceptance(method)
    assert request.score_scale() == 1.0  # nothing seen: as scored
    for _ in range(20):  # scored 2 tokens a draft, 1 accepted
        request.observe(3, 1, score=2.0)
    assert request.score_scale() == pytest.approx(0.5, abs=0.05)
    request.observe(3, 3)  # a draft without a score (a lookup) says nothing about scores
    assert request.score_scale() == pytest.approx(0.5, abs=0.05)
    # A new request starts from its method's, and its own drafts move it.
    later = RequestAcceptance(method)
    assert later.score_scale() == pytest.approx(0.5, abs=0.05)
    for _ in range(20):
        later.observe(3, 3, score=1.5)
    assert later.score_scale() > 1.5
