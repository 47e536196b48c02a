"""Where a drafter's draft stops paying for its verification (gateway/break_even.py)."""

import pytest

from gateway.break_even import MethodAcceptance, PositionCounts, RequestAcceptance, break_even


def test_a_draft_token_must_be_surer_the_busier_the_verifier():
    assert break_even(0.0, 32) == 0.0  # free draft tokens (an accelerator's idle compute) always pay
    assert break_even(0.17, 1) == pytest.approx(0.17)  # alone: its own relative cost
    assert break_even(0.17, 0) == break_even(0.17, 1)
    thresholds = [break_even(0.17, n) for n in (1, 4, 16, 32)]
    assert thresholds == sorted(thresholds)
    # At 32 sequences a CPU pass is compute-bound: a token must land 87% of the time.
    assert break_even(0.17, 32) == pytest.approx(0.17 * 32 / (0.83 + 0.17 * 32))


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
    assert request.worthwhile_length(break_even(0.17, 32), limit=8) == 8  # nothing known: explore
    for _ in range(6):
        request.observe(num_draft_tokens=8, num_accepted=1)  # the first token lands, the second never
    assert request.worthwhile_length(break_even(0.17, 1), limit=8) == 1
    assert request.worthwhile_length(break_even(0.17, 32), limit=8) == 1  # 6 of 6 first tokens: still pays
    for _ in range(6):
        request.observe(num_draft_tokens=1, num_accepted=0)
    assert request.worthwhile_length(break_even(0.17, 1), limit=8) == 1  # half its first tokens land
    assert request.worthwhile_length(break_even(0.17, 32), limit=8) == 0


def test_a_new_request_starts_from_what_its_method_has_seen():
    method = MethodAcceptance()
    for _ in range(20):
        RequestAcceptance(method).observe(num_draft_tokens=4, num_accepted=0)
    fresh = RequestAcceptance(method)
    assert fresh.worthwhile_length(break_even(0.17, 16), limit=4) == 0
    for _ in range(8):
        fresh.observe(num_draft_tokens=4, num_accepted=4)  # this one's drafts land: its own record wins
    assert fresh.worthwhile_length(break_even(0.17, 16), limit=4) == 4
