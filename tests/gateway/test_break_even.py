"""Where a drafter's draft stops paying for its verification (gateway/break_even.py)."""

import pytest

from gateway.break_even import EXPLORE_EVERY, MethodAcceptance, PositionCounts, RequestAcceptance


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
    assert request.worthwhile_length(0.36, limit=8) == 8  # nothing known: every position explored
    for _ in range(6):
        request.observe(num_draft_tokens=8, num_accepted=1)  # the first token lands, the second never
    assert request.worthwhile_length(0.17, limit=8) == 1
    assert request.worthwhile_length(0.36, limit=8) == 1  # 6 of 6 first tokens: still pays
    for _ in range(10):
        request.observe(num_draft_tokens=1, num_accepted=0)
    assert request.worthwhile_length(0.17, limit=8) == 1  # 6 in 16 first tokens land
    assert request.worthwhile_length(0.5, limit=8) == 0


def test_a_request_with_every_draft_cut_still_tries_one_token_now_and_then():
    request = RequestAcceptance(MethodAcceptance())
    for _ in range(8):
        request.observe(num_draft_tokens=4, num_accepted=0)
    lengths = [request.worthwhile_length(0.5, limit=4) for _ in range(3 * EXPLORE_EVERY)]
    assert lengths == ([0] * (EXPLORE_EVERY - 1) + [1]) * 3


def test_a_new_request_starts_from_what_its_method_has_seen():
    method = MethodAcceptance()
    for _ in range(20):
        RequestAcceptance(method).observe(num_draft_tokens=4, num_accepted=0)
    fresh = RequestAcceptance(method)
    assert fresh.worthwhile_length(0.3, limit=4) == 0
    for _ in range(4):
        fresh.observe(num_draft_tokens=4, num_accepted=4)  # this one's drafts land: its own record wins
    assert fresh.worthwhile_length(0.3, limit=4) == 4
