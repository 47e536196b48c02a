"""The propose -> verify loop: one sequence's generation across the drafter and
a verifier. The gateway is the only service that talks to both; what each step
does is the step planner's decision (gateway/planner.py)."""

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import grpc
import structlog

from gateway.drafter_client import DrafterClient, DrafterSession
from gateway.errors import InvalidRequest, Overloaded, Unavailable
from gateway.estimates import (
    REQUEST_HEAD_WEIGHT,
    SERVER_HEAD_WEIGHT,
    HeadWorth,
    MethodAcceptance,
    RequestAcceptance,
    RoundTrip,
    head_step_worth,
    lookup_loss,
)
from gateway.metrics import GatewayMetrics, StepTimes
from gateway.next_round import offer_outcome
from gateway.planner import (
    DRAFTER,
    EXPLORE_EVERY,
    HEAD,
    LOOKUP,
    PREDICTION,
    Budget,
    Measurements,
    PlannerPolicy,
    Step,
    StepState,
    draft_budget,
    plan_step,
)
from gateway.prediction import PredictionDrafter
from gateway.types import GenerationRequest, SpeculationUsage, TokenDelta, TokenLogprob
from gateway.verifier_pool import VerifierPool
from protos.common.v1 import common_pb2
from protos.conventions import FINISH_REASON_NAMES
from protos.verifier.v1 import verifier_pb2
from speclane.speculation import DRAFTER_METHODS, token_cost_at

log = structlog.get_logger()


class Orchestrator:
    def __init__(self, verifiers: VerifierPool, drafter: DrafterClient | None, metrics: GatewayMetrics,
                 policy: PlannerPolicy = PlannerPolicy()):
        self._verifiers = verifiers
        self._policy = policy
        self._drafter = drafter
        self._metrics = metrics
        # Drafter sessions finishing in the background; kept so they are not garbage-collected.
        self._finishing: set[asyncio.Task] = set()
        # Each drafter method's acceptance by draft position, over all requests: a new request's prior.
        self._acceptance = {method: MethodAcceptance() for method in DRAFTER_METHODS}
        # What the head's steps have been worth, any method's: a hybrid request's prior.
        self._head_worth = HeadWorth(SERVER_HEAD_WEIGHT)
        self._round_trips: defaultdict[int, RoundTrip] = defaultdict(RoundTrip)  # by verifier number

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Yields each step's committed tokens; closing the generator aborts the sequence.
        Each step: plan the draft's budget, ask the drafter where it pays, plan the
        step (gateway/planner.py), send it, stream the last step's tokens while the
        verifier runs it, learn from its answer."""
        index, verifier, sequence = None, None, None
        try:
            drafter = await self._open_drafter(request)
            sequence = _Sequence(self, request, drafter)
            index, verifier, result = await self._prefill(request)
            sequence.started(index, result)
            while result.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                state, measured = sequence.state(result), sequence.measure(result)
                budget = draft_budget(self._policy, state, measured)
                drafted, drafter_seconds = await sequence.draft(result, budget)
                step = plan_step(state, measured, budget, drafted, sequence.predicted(result, budget.limit))
                sent = time.perf_counter()
                await _checked(_send_step(verifier, result, step))
                yield _delta(result, sequence)  # streamed while the verifier runs the step
                result = await _checked(verifier.answer())
                sequence.observe(step, result, drafter_seconds, time.perf_counter() - sent)
            sequence.finish(result)
            yield _delta(result, sequence, FINISH_REASON_NAMES[result.finish_reason])
        except Unavailable:
            if index is not None:
                self._verifiers.mark_down(index)
            raise
        finally:
            if index is not None:
                verifier.close()
                self._verifiers.release(index)
            if sequence is not None:
                sequence.close()

    async def _open_drafter(self, request: GenerationRequest) -> DrafterSession | None:
        """Opened before the prefill, so the drafter indexes the prompt while the verifier prefills.
        Hybrid's drafter steps look ahead too: on copy-heavy output they are most of its steps."""
        if self._drafter is None or not request.speculation.feeds_drafter:
            return None
        lookahead = self._policy.next_round and request.speculation.uses_drafter
        return await self._drafter.open(request, lookahead=lookahead)

    async def _prefill(self, request: GenerationRequest):
        """The prompt's first token, from a serving verifier. One found gone is
        marked down and the next tried: nothing has reached the client yet, so
        the request fails over unseen. Unavailable once none is left."""
        for _ in range(len(self._verifiers.addresses)):
            index, verifier = self._verifiers.open(request.request_id, request.prompt_token_ids)
            try:
                return index, verifier, await _checked(verifier.prefill(request))
            except BaseException as exc:
                verifier.close()
                self._verifiers.release(index)
                if not isinstance(exc, Unavailable):
                    raise
                self._verifiers.mark_down(index)
        raise Unavailable("no verifier answered the prefill; retry shortly")

    def _finish_in_background(self, drafter: DrafterSession, committed: list[int], committed_len: int) -> None:
        task = asyncio.ensure_future(drafter.finish(committed, committed_len))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)


class _Sequence:
    """One request's side of the loop: its drafter session and the tokens it has
    not been sent yet, its predicted output, the offers in flight, its estimates
    (what the planner measures) and its usage."""

    def __init__(self, loop: Orchestrator, request: GenerationRequest, drafter: DrafterSession | None):
        self._loop = loop
        self._speculation = speculation = request.speculation
        self._drafter = drafter
        self._proposer = drafter if speculation.uses_drafter else None  # a head's output only feeds it
        self._prediction = PredictionDrafter(request.prediction_token_ids) if request.prediction_token_ids else None
        policy = loop._policy
        self._lookahead = policy.next_round and self._proposer is not None
        self._acceptance = (RequestAcceptance(loop._acceptance[speculation.drafter_method])
                            if policy.break_even and self._proposer is not None else None)
        self._head = HeadWorth(REQUEST_HEAD_WEIGHT, loop._head_worth.worth) if speculation.method == "hybrid" else None
        self._cut_steps = 0
        self._offered: tuple = ()  # the offers sent with the step in flight
        self._withheld: list[int] = []  # committed tokens not yet sent to the drafter
        self._output: list[int] = []
        self.usage = SpeculationUsage()  # immutable: each delta carries its own snapshot
        self.cached_tokens = 0  # of the prompt, from the prefill's answer

    def started(self, index: int, prefilled) -> None:
        self._round_trip = self._loop._round_trips[index]
        self._output += prefilled.token_ids
        self.cached_tokens = prefilled.num_cached_tokens

    def state(self, last) -> StepState:
        looked_up = last.lookup_draft if last.next_round_hit and last.HasField("lookup_draft") else None
        settings, policy = self._speculation, self._loop._policy
        return StepState(settings.method, settings.num_speculative_tokens, self._lookahead, last.next_round_hit,
                         looked_up, last.committed_len, last.token_ids[-1], self._offered, policy.next_round,
                         settings.suffix_decoding_max_spec_factor, settings.suffix_decoding_min_token_prob)

    def measure(self, last) -> Measurements:
        """What the planner needs to know, at the verifier's load as it last reported it."""
        policy = self._loop._policy
        lookup = policy.lookup == "on" or (policy.lookup == "auto"
                                           and self._round_trip.lookup_pays(EXPLORE_EVERY))
        return Measurements(
            last.num_running, token_cost_at(policy.draft_token_costs, last.num_running),
            token_cost_at(policy.draft_token_costs, 1),
            self._acceptance.rates(self._speculation.num_speculative_tokens) if self._acceptance else None,
            self._cut_steps, self._head.worth if self._head else None, lookup,
            self._acceptance.score_scale() if self._acceptance else 1.0)

    async def draft(self, last, budget: Budget) -> tuple[common_pb2.Draft, float]:
        """The drafter's draft continuing the committed tokens (asked only where the
        budget says so), and the time it took. A drafter that refuses the request
        makes it a 400: drafted before the last step's tokens go out."""
        self._withheld += last.token_ids
        asked = time.perf_counter()
        drafted = None
        if budget.ask_drafter:
            if self._proposer is not None and self._proposer.alive:
                drafted = await self._proposer.propose(self._withheld, last.committed_len, budget.max_spec_factor,
                                                       budget.min_token_prob)
            self._withheld = []
        return drafted or common_pb2.Draft(), time.perf_counter() - asked

    def predicted(self, last, max_tokens: int) -> common_pb2.Draft | None:
        """The predicted output's continuation; None when the output has left the prediction."""
        if self._prediction is None:
            return None
        self._prediction.advance(last.token_ids)
        tokens = self._prediction.draft(max_tokens)
        return common_pb2.Draft(token_ids=tokens, source="prediction") if tokens else None

    def observe(self, step: Step, result, drafter_seconds: float, verifier_seconds: float) -> None:
        """A step's answer: the usage, and what the estimates learn from it."""
        loop, ran_ahead = self._loop, step.ran_ahead
        self._offered, self._cut_steps = step.offers, step.budget.cut_steps
        if step.offers or step.lookup_tokens:
            loop._metrics.record_next_round(offer_outcome(result))
        self.usage += _step_usage(result, step.source, ran_ahead)
        if step.source == HEAD:
            worth = head_step_worth(result, token_cost_at(loop._policy.draft_token_costs, 1))
            loop._head_worth.observe(worth)
            if self._head is not None:
                self._head.observe(worth)
        if step.source in (DRAFTER, LOOKUP) and self._acceptance is not None:
            self._acceptance.observe(result.num_draft_tokens, result.num_accepted_draft_tokens,
                                     step.draft.score if step.source == DRAFTER else 0.0)
        self._output += result.token_ids
        loss = (lookup_loss(list(step.drafter_draft.token_ids), result.num_accepted_draft_tokens,
                            list(result.token_ids)) if step.source == LOOKUP else None)
        self._round_trip.observe_step(len(result.token_ids), loss)
        times = StepTimes(drafter_seconds, verifier_seconds, result.step_seconds, result.forward_seconds,
                          result.head_draft_seconds)
        loop._metrics.record_verify_step(result.num_draft_tokens, result.num_accepted_draft_tokens)
        loop._metrics.record_step_times(times)
        # The step after the prefill always waits, and a step the verifier started itself did not wait:
        # neither tells what a lookup would save.
        if not ran_ahead and self.usage.verify_steps > 1:
            self._round_trip.observe_wait(times.network + times.drafter_wait, times.forward)
        log.debug("verify_step", source=step.source, draft_tokens=result.num_draft_tokens,
                  accepted=result.num_accepted_draft_tokens, **times.milliseconds())

    def finish(self, last) -> None:
        """Hands the drafter the tokens it has not been sent (the last steps', or all of them
        where a head drafted), in the background, so its global tree learns the whole output."""
        if self._drafter is not None:
            unsent = self._withheld + list(last.token_ids) if self._proposer is not None else self._output
            self._loop._finish_in_background(self._drafter, unsent, last.committed_len)
            self._drafter = None

    def close(self) -> None:
        if self._drafter is not None:
            self._drafter.close()


def _delta(result, sequence: "_Sequence", finish_reason: str | None = None) -> TokenDelta:
    """A step's tokens, with the request's usage so far (a stop string may end it at any step)."""
    logprobs = tuple(TokenLogprob(entry.logprob, tuple(zip(entry.top_token_ids, entry.top_logprobs)))
                     for entry in result.logprobs)
    return TokenDelta(list(result.token_ids), finish_reason, sequence.usage, logprobs, sequence.cached_tokens)


def _send_step(verifier, last, step: Step):
    """Sends a step's draft, or nothing when the verifier already runs it,
    with its offers for the step after, and where none matches, a prompt
    lookup of up to step.lookup_tokens, or no draft (run_ahead), or a wait."""
    next_round = (verifier_pb2.NextRound(step_committed_len=last.committed_len, continuations=step.offers,
                                         lookup_tokens=step.lookup_tokens, run_ahead=step.run_ahead)
                  if step.offers or step.lookup_tokens or step.run_ahead else None)
    if step.ran_ahead:
        return verifier.send_offer(next_round)
    return verifier.send_verify(step.draft, use_head_draft=step.source == HEAD, next_round=next_round)


def _step_usage(result, source: str, ran_ahead: bool) -> SpeculationUsage:
    drafted, accepted = result.num_draft_tokens, result.num_accepted_draft_tokens
    return SpeculationUsage(drafted, accepted, 1, *((drafted, accepted) if source == PREDICTION else (0, 0)),
                            drafter_steps=int(source == DRAFTER), head_steps=int(source == HEAD),
                            next_round_steps=int(ran_ahead))


async def _checked(call):
    """Maps the verifier's status codes to the gateway's client-facing errors."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequest(exc.details()) from None
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded(exc.details()) from None
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # gone, restarting or still loading
            raise Unavailable(f"the verifier is unavailable: {exc.details()}") from None
        raise
