"""The step planner: what one propose/verify step of a request does, decided
from the request's state and the measurements (gateway/estimates.py). Pure:
no gRPC calls, no clock, no state of its own. The loop (gateway/orchestrator.py)
and the policy replay (`speclane bench policy`) both call it.

A step is planned in two halves around the drafter's answer:
- draft_budget: how long a draft may be at the verifier's load, how much of a
  drafter's draft pays for its verification (the break-even cut), and whether
  to ask the drafter at all;
- plan_step: which source drafts (a predicted output, the verifier's head,
  the drafter, a lookup the verifier already started, or none), and which
  next-round offers and lookup tokens go with it, and whether the verifier
  may start the step after without a draft (run_ahead).
docs/design/step-planner.md explains the rules and why."""

import math
from dataclasses import dataclass

from gateway.next_round import continuations_after, cut, offered_draft, step_part
from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2
from speclane.speculation import HEAD_METHODS, draft_value

SUFFIX_METHODS = ("suffix", "hybrid")  # the drafter drafts by suffix decoding
# Where a step's draft came from; LOOKUP: the verifier's own prompt lookup (NextRound.lookup_tokens).
PREDICTION, DRAFTER, HEAD, LOOKUP, NONE = "prediction", "drafter", "head", "lookup", "none"
# A policy that has stopped something still tries it once every this many steps, or its
# estimate could never recover: a request whose drafts are all cut verifies one draft token
# (a chat turn that starts quoting code, a method-wide prior learnt on other traffic), and
# while lookups do not pay, a missed step looks up, so their loss is measured again.
EXPLORE_EVERY = 4
# A suffix draft's budget per matched token by what a draft token costs (in plain steps): (below this cost,
# the session's max_spec_factor times this, min_token_prob at least this). In a big batch only a long match's
# confident guess pays for its tokens; alone, a short match's does. The best of each on the four data sets'
# recorded replies (`speclane bench policy`, docs/design/step-planner.md).
SUFFIX_BUDGET_BY_COST = ((0.12, 2.0, 0.0), (0.3, 1.0, 0.5), (math.inf, 0.5, 0.5))


@dataclass(frozen=True)
class PlannerPolicy:
    """The server-wide rules; the defaults are what ships (the switches: --speculation-debug, for experiments)."""

    # The verifier's measure of a draft token's cost by batch size ((batch size, cost), by size).
    draft_token_costs: tuple[tuple[int, float], ...] = ()
    # (fewest, most running sequences, at most this many draft tokens): vLLM's disable_by_batch_size
    # and num_speculative_tokens_per_batch_size, checked at every step.
    draft_tokens_by_load: tuple[tuple[int, int, int], ...] = ()
    next_round: bool = True  # offer the verifier the drafts after each step
    lookup: str = "auto"  # let it look up a step no offer foresaw: "auto" (where it pays), "on", "off"
    break_even: bool = True  # cut a drafter's draft where its tokens stop paying


@dataclass(frozen=True)
class StepState:
    """A request at the start of a step: its settings and the last verify answer."""

    method: str
    k: int
    lookahead: bool  # the drafter drafts past each step, so next-round offers can be made
    ran_ahead: bool  # the verifier already runs this step, on one of `offered` or its own lookup
    looked_up: common_pb2.Draft | None  # the verifier's lookup draft, where it ran ahead on one
    committed_len: int
    last_token: int
    offered: tuple[verifier_pb2.Continuation, ...]  # the offers sent with the step before
    next_round: bool = True  # the policy lets the verifier start steps itself (PlannerPolicy.next_round)
    # The session's suffix budget (suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob).
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1


@dataclass(frozen=True)
class Measurements:
    running: int  # sequences on the verifier, every client's, as it last reported
    token_cost: float  # a draft token's cost at that load, in plain steps
    alone_token_cost: float  # its cost with one sequence: the head's worth is judged at it
    acceptance: tuple[float, ...] | None  # per position, the chance of acceptance once reached; None: no cut
    cut_steps: int  # steps in a row whose drafter draft was cut whole
    head_worth: float | None  # hybrid: what the request's head steps have been worth
    lookup_pays: bool
    score_scale: float = 1.0  # hybrid: what the drafter's drafts accept per token of their score


@dataclass(frozen=True)
class Budget:
    limit: int  # draft tokens at most, of any source
    drafter_limit: int  # of a drafter's draft: the part that pays
    ask_drafter: bool
    cut_steps: int
    # The suffix tree's budget for this step's draft, in place of the session's (None: the session's).
    max_spec_factor: float | None = None
    min_token_prob: float | None = None


@dataclass(frozen=True)
class Step:
    source: str
    draft: common_pb2.Draft | None  # None: the head's (the verifier has it)
    offers: tuple[verifier_pb2.Continuation, ...]
    lookup_tokens: int
    drafter_draft: common_pb2.Draft  # the drafter's draft for this step, cut: what a lookup is measured against
    budget: Budget
    ran_ahead: bool  # the verifier already runs it: only the offers go out
    run_ahead: bool = False  # where no offer matches, the verifier starts the step after without a draft


def draft_budget(policy: PlannerPolicy, state: StepState, measured: Measurements) -> Budget:
    """Less than k while the verifier is busy (a big batch is compute-bound, so a
    draft token costs what another sequence's token does), and of a drafter's
    draft only the positions whose chance of being reached and accepted beats
    that cost. A step with no drafter draft to verify does not ask for one: its
    tokens go with the next ask, which spares the drafter's work where drafts
    do not pay. A step the verifier runs ahead still asks: its offers need one.
    A suffix draft is asked for under the budget per matched token that pays
    at the load (suffix_budget)."""
    limit = min([state.k, *(tokens for fewest, most, tokens in policy.draft_tokens_by_load
                            if fewest <= measured.running <= most)])
    drafter_limit, cut_steps = limit, measured.cut_steps
    factor = min_prob = None
    if measured.acceptance is not None:
        drafter_limit, cut_steps = break_even_length(measured.acceptance[:limit], measured.token_cost,
                                                     measured.cut_steps)
        if state.method in SUFFIX_METHODS:
            factor, min_prob = suffix_budget(measured.token_cost, state.max_spec_factor, state.min_token_prob)
    return Budget(limit, drafter_limit, drafter_limit > 0 or state.ran_ahead, cut_steps, factor, min_prob)


def suffix_budget(token_cost: float, max_spec_factor: float, min_token_prob: float) -> tuple[float, float]:
    """(max_spec_factor, min_token_prob) of a suffix draft at a draft token's `token_cost`, from the session's."""
    scale, floor = next((scale, floor) for below, scale, floor in SUFFIX_BUDGET_BY_COST if token_cost < below)
    return max_spec_factor * scale, max(min_token_prob, floor)


def break_even_length(acceptance: tuple[float, ...], token_cost: float, cut_steps: int) -> tuple[int, int]:
    """The longest draft whose last token is still reached and accepted with a chance
    of at least `token_cost` (what it costs, in plain steps, is what it must commit),
    one token every EXPLORE_EVERY steps that would be cut whole; and the new count of
    such steps in a row."""
    chance, length = 1.0, len(acceptance)
    for position, rate in enumerate(acceptance):
        chance *= rate
        if chance < token_cost:
            length = position
            break
    cut_steps = cut_steps + 1 if length == 0 and acceptance else 0
    return (1, 0) if cut_steps == EXPLORE_EVERY else (length, cut_steps)


def plan_step(state: StepState, measured: Measurements, budget: Budget, drafted: common_pb2.Draft,
              predicted: common_pb2.Draft | None) -> Step:
    """The step's source and draft, from `drafted` (all the drafter drafted, past
    the step where it looks ahead) and `predicted` (the predicted output's
    continuation), with the offers for the step after.

    Next round: with the drafter's draft, the verifier is offered the drafts
    after it for its likely outcomes: "all accepted, then the drafter's next
    token" and the drafter's detours, "accepted up to here, then this token".
    When one of them is what happens the verifier starts it at once; where the
    round trip's wait is worth more than what lookups lose, it also starts the
    steps no offer foresaw, with a draft it looks up itself. Hybrid offers only
    the drafts that beat the head's, and looks up only while the drafter's draft
    does: the step after is left to the head otherwise."""
    drafter_draft = cut(step_part(drafted), 0, budget.drafter_limit)
    if state.ran_ahead and state.looked_up is not None:
        source, draft = LOOKUP, state.looked_up
    elif state.ran_ahead:  # on the offer the outcome matched, else without a draft (run_ahead)
        offer = offered_draft(state.offered, state.committed_len, state.last_token)
        source, draft = (DRAFTER, offer) if offer is not None else (NONE, common_pb2.Draft())
    elif budget.limit == 0:  # a head's draft is not shortened here: only switched off
        source, draft = NONE, common_pb2.Draft()
    else:
        source, draft = pick_draft(state.method, predicted, drafter_draft, measured)
    drafter_step = state.lookahead and source in (DRAFTER, LOOKUP, NONE)  # NONE: the drafter had nothing
    offers = (continuations_after(draft, drafted, budget.drafter_limit)
              if drafter_step and source != NONE and budget.limit > 0 else [])
    lookup = drafter_step and measured.lookup_pays
    if measured.head_worth is not None:  # hybrid: a step the verifier starts itself never gets the head's draft
        offers = [offer for offer in offers if not prefers_head(offer.draft, measured)]
        lookup = lookup and not prefers_head(drafter_draft, measured)
    lookup_tokens = budget.drafter_limit if lookup else 0
    # Nothing will draft the step after either (plain decoding, or drafts off at this load): the verifier
    # starts it at once instead of waiting a round trip for an empty Verify.
    run_ahead = state.next_round and predicted is None and (state.method == "none" or budget.limit == 0)
    return Step(source, draft, tuple(offers), lookup_tokens, drafter_draft, budget, state.ran_ahead, run_ahead)


def pick_draft(method: str, predicted: common_pb2.Draft | None, drafted: common_pb2.Draft,
               measured: Measurements) -> tuple[str, common_pb2.Draft | None]:
    """A predicted output wins while it lasts: the client told us what it
    expects. Hybrid takes the draft expected to commit more tokens per unit of
    step time, the drafter's judged by its score, the head's by what its steps
    have committed in this request (estimates.head_step_worth). Arctic's rule
    compares the suffix score with the head draft's length, as if every head
    token were accepted and verification were free; on a CPU verifier neither
    holds, and it needs the head's draft made at every step to know its length."""
    if predicted is not None:
        return PREDICTION, predicted
    if method in HEAD_METHODS or (measured.head_worth is not None and prefers_head(drafted, measured)):
        return HEAD, None
    return (DRAFTER, drafted) if drafted.token_ids else (NONE, drafted)


def prefers_head(drafted: common_pb2.Draft, measured: Measurements) -> bool:
    """Whether the head's draft is expected to commit more per unit of verify time
    than `drafted`, whose expected accepted tokens are its score as the drafter's
    scores have turned out (Measurements.score_scale)."""
    n = len(drafted.token_ids)
    return not n or draft_value(drafted.score * measured.score_scale, n,
                                measured.alone_token_cost) < measured.head_worth
