"""The step planner's rules (gateway/planner.py), one at a time; test_planner_replay.py checks them together."""

from gateway.planner import (
    DRAFTER,
    HEAD,
    LOOKUP,
    NONE,
    Measurements,
    PlannerPolicy,
    StepState,
    draft_budget,
    plan_step,
    suffix_budget,
)
from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2

# The drafter looked ahead: 3 tokens for the step (step_len), then its guess of the bonus token and 3 more.
DRAFTED = common_pb2.Draft(token_ids=[1, 2, 3, 4, 5, 6, 7], step_len=3, committed_len=10)


def state(method="suffix", ran_ahead=False, looked_up=None, offered=()) -> StepState:
    return StepState(method, 3, True, ran_ahead, looked_up, 10, 9, offered)


def measured(acceptance=None, lookup_pays=False, head_worth=None, running=1, score_scale=1.0,
             token_cost=0.2) -> Measurements:
    return Measurements(running, token_cost, token_cost, acceptance, 0, head_worth, lookup_pays, score_scale)


def plan(step_state, step_measured, drafted=DRAFTED, policy=PlannerPolicy()):
    budget = draft_budget(policy, step_state, step_measured)
    return budget, plan_step(step_state, step_measured, budget, drafted, None)


def test_a_drafter_step_verifies_its_own_part_and_offers_the_step_after():
    budget, step = plan(state(), measured())
    assert (budget.limit, budget.drafter_limit, budget.ask_drafter) == (3, 3, True)
    assert (step.source, list(step.draft.token_ids), step.lookup_tokens) == (DRAFTER, [1, 2, 3], 0)
    [offer] = step.offers
    assert (offer.bonus_token_id, list(offer.draft.token_ids), offer.draft.committed_len) == (4, [5, 6, 7], 14)


def test_where_no_draft_token_pays_the_drafter_is_not_asked():
    budget, step = plan(state(), measured(acceptance=(0.1, 0.1, 0.1)), drafted=common_pb2.Draft())
    assert (budget.drafter_limit, budget.ask_drafter, step.source, step.offers) == (0, False, NONE, ())


def test_where_the_verifier_ran_ahead_the_drafter_is_still_asked_for_the_offers_after():
    budget, _ = plan(state(ran_ahead=True, looked_up=common_pb2.Draft(token_ids=[8])),
                     measured(acceptance=(0.1, 0.1, 0.1)))
    assert budget.ask_drafter
    _, step = plan(state(ran_ahead=True, looked_up=common_pb2.Draft(token_ids=[8])), measured())
    assert (step.source, list(step.draft.token_ids), step.ran_ahead) == (LOOKUP, [8], True)


def test_lookups_go_with_drafter_steps_where_they_pay():
    assert plan(state(), measured(lookup_pays=True))[1].lookup_tokens == 3
    assert plan(state(method="eagle3"), measured(lookup_pays=True))[1].lookup_tokens == 0  # a head step


def test_at_a_load_that_allows_no_draft_nothing_is_drafted_or_offered():
    policy = PlannerPolicy(draft_tokens_by_load=((8, 64, 0),))
    budget, step = plan(state(method="eagle3"), measured(running=8), policy=policy)
    assert (budget.limit, step.source, step.offers) == (0, NONE, ())
    assert plan(state(method="eagle3"), measured(running=7), policy=policy)[1].source == HEAD


def test_plain_decoding_and_drafts_off_at_the_load_let_the_verifier_run_ahead():
    """With nothing to draft for the step after, the verifier should not wait a round trip for an empty Verify;
    a step it ran ahead that way verifies no draft."""
    _, plain = plan(state("none"), measured(), drafted=common_pb2.Draft())
    assert plain.run_ahead and plain.source == NONE
    off_at_load = PlannerPolicy(draft_tokens_by_load=((33, 64, 0),))
    assert plan(state(), measured(running=40), policy=off_at_load)[1].run_ahead
    assert not plan(state(), measured(running=8), policy=off_at_load)[1].run_ahead  # drafts pay here
    assert not plan(state(), measured())[1].run_ahead
    _, no_next_round = plan(StepState("none", 3, False, False, None, 10, 9, (), next_round=False), measured())
    assert not no_next_round.run_ahead
    _, after = plan(state("none", ran_ahead=True), measured(), drafted=common_pb2.Draft())
    assert after.source == NONE and not after.draft.token_ids and after.ran_ahead


def test_hybrid_leaves_the_step_after_to_the_head_where_the_drafters_drafts_lose_to_it():
    """An offer or a lookup makes the verifier start the step after itself, without the head's draft."""
    confident = common_pb2.Draft(token_ids=[1, 2, 3, 4, 5, 6, 7], confidences=[0.9] * 7, score=2.7, step_len=3,
                                 committed_len=10)
    # The drafter's drafts worth (1 + 2.7) / 1.6 = 2.3 a unit of verify time: beyond a head worth 1.5.
    _, step = plan(state("hybrid"), measured(head_worth=1.5, lookup_pays=True), drafted=confident)
    assert (step.source, len(step.offers), step.lookup_tokens) == (DRAFTER, 1, 3)
    # A step the verifier ran ahead on an offer: the offers after it are judged as well. Where the drafter's
    # scores have promised twice what its drafts accepted, (1 + 1.35) / 1.6 = 1.47 loses to a head worth 1.6.
    offered = (verifier_pb2.Continuation(bonus_token_id=9, draft=common_pb2.Draft(token_ids=[1, 2, 3],
                                                                                  committed_len=10)),)
    ran_ahead = state("hybrid", ran_ahead=True, offered=offered)
    _, step = plan(ran_ahead, measured(head_worth=1.6, lookup_pays=True), drafted=confident)
    assert (step.source, len(step.offers), step.lookup_tokens) == (DRAFTER, 1, 3)
    _, step = plan(ran_ahead, measured(head_worth=1.6, lookup_pays=True, score_scale=0.5), drafted=confident)
    assert (step.source, step.offers, step.lookup_tokens) == (DRAFTER, (), 0)
    # Suffix decoding without a head offers and looks up as before.
    _, step = plan(state("suffix"), measured(lookup_pays=True, score_scale=0.5), drafted=confident)
    assert (len(step.offers), step.lookup_tokens) == (1, 3)


def test_a_suffix_draft_is_asked_for_under_the_budget_that_pays_at_the_load():
    """Alone a short match's guess pays, in a big batch only a long match's confident one: the budget per matched
    token falls and the probability floor rises with a draft token's cost, from the session's settings."""
    assert suffix_budget(0.05, 1.0, 0.1) == (2.0, 0.1)
    assert suffix_budget(0.2, 1.0, 0.1) == (1.0, 0.5)
    assert suffix_budget(0.4, 1.0, 0.1) == (0.5, 0.5)
    assert suffix_budget(0.4, 2.0, 0.7) == (1.0, 0.7)  # a session's own stricter floor stays
    rates = (0.9, 0.9, 0.9)
    for method, expected in (("suffix", (0.5, 0.5)), ("hybrid", (0.5, 0.5)), ("ngram", (None, None))):
        budget = draft_budget(PlannerPolicy(), state(method), measured(acceptance=rates, token_cost=0.4))
        assert (budget.max_spec_factor, budget.min_token_prob) == expected, method
    # With the break-even cut off (no acceptance to judge by), the session's budget stands.
    budget = draft_budget(PlannerPolicy(break_even=False), state(), measured(token_cost=0.4))
    assert (budget.max_spec_factor, budget.min_token_prob) == (None, None)
