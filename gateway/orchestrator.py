"""The propose -> verify loop: one sequence's generation across the drafter and
a verifier. The gateway is the only service that talks to both."""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog

from gateway.break_even import MethodAcceptance, RequestAcceptance
from gateway.draft_length import AdaptiveDraftLength
from gateway.drafter_client import DrafterClient, DrafterSession
from gateway.errors import InvalidRequest, Overloaded, Unavailable
from gateway.hybrid import REQUEST_WEIGHT, SERVER_WEIGHT, HeadWorth, HybridChoice, head_step_worth
from gateway.metrics import GatewayMetrics, StepTimes
from gateway.next_round import continuations_after, cut, offer_outcome, offered_draft, step_part
from gateway.prediction import PredictionDrafter
from gateway.round_trip import RoundTrip, looks_up, lookup_loss
from gateway.types import GenerationRequest, SpeculationUsage, TokenDelta, TokenLogprob
from gateway.verifier_pool import VerifierPool
from protos.common.v1 import common_pb2
from protos.conventions import FINISH_REASON_NAMES
from protos.verifier.v1 import verifier_pb2
from speclane.speculation import DRAFTER_METHODS, HEAD_METHODS, token_cost_at

log = structlog.get_logger()
_NO_DRAFT = common_pb2.Draft()
# Where a step's draft came from; LOOKUP: the verifier's own prompt lookup (NextRound.lookup_tokens).
PREDICTION, DRAFTER, HEAD, LOOKUP, NONE = "prediction", "drafter", "head", "lookup", "none"


@dataclass(frozen=True)
class LoopPolicy:
    """The loop's server-wide choices: from --speculative-config and the verifiers' ModelInfo."""

    # The verifiers' measure of a draft token's cost by batch size ((batch size, cost), by size).
    draft_token_costs: tuple[tuple[int, float], ...] = ()
    # (running sequences, at most this many draft tokens): from that many sequences on a
    # verifier, its steps verify shorter drafts, or none. Checked at every step rather than
    # once per request: a long generation speculates again when the load falls.
    draft_tokens_by_load: tuple[tuple[int, int], ...] = ()
    # Offer the verifiers next-round drafts (they accept them): see generate().
    next_round: bool = False
    # Let verifiers draft a step whose offers missed by prompt lookup: "on", "off", or "auto" (gateway/round_trip.py).
    next_round_lookup: str = "off"
    # Adapt each request's draft length to its acceptance (gateway/draft_length.py).
    adaptive_draft_length: bool = False
    # Cut a drafter's draft where its tokens' chance of acceptance no longer pays at the load (gateway/break_even.py).
    break_even: bool = False

    @property
    def draft_token_cost(self) -> float:
        """The cost with one sequence in a step."""
        return token_cost_at(self.draft_token_costs, 1)

    def max_draft_tokens(self, num_running: int, k: int) -> int:
        """A step's draft length limit, k at most, with `num_running` sequences on its verifier."""
        return min([k, *(limit for at_least, limit in self.draft_tokens_by_load if num_running >= at_least)])

    def paying_draft_tokens(self, num_running: int, limit: int, acceptance: RequestAcceptance | None) -> int:
        """How much of a drafter's draft (not a head's: see generate) pays for its verification."""
        if acceptance is None:
            return limit
        return acceptance.worthwhile_length(token_cost_at(self.draft_token_costs, num_running), limit)


class Orchestrator:
    def __init__(self, verifiers: VerifierPool, drafter: DrafterClient | None, metrics: GatewayMetrics,
                 policy: LoopPolicy = LoopPolicy()):
        self._verifiers = verifiers
        self._policy = policy
        self._drafter = drafter
        self._metrics = metrics
        # Drafter sessions finishing in the background; kept so they are not garbage-collected.
        self._finishing: set[asyncio.Task] = set()
        # Each drafter method's acceptance by draft position, over all requests: a new request's prior.
        self._acceptance = {method: MethodAcceptance() for method in DRAFTER_METHODS}
        # What the head's steps have been worth, any method's: a hybrid request's prior.
        self._head_worth = HeadWorth(SERVER_WEIGHT)
        self._round_trips = [RoundTrip() for _ in verifiers.addresses]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Yields each step's committed tokens; closing the generator aborts the sequence.

        Next round: with the drafter's draft, the loop offers the verifier the
        drafts after it for its likely outcomes: "all accepted, then the
        drafter's next token" (the drafter drafts that far ahead), and the
        drafter's detours, "accepted up to here, then this token". When one of
        them is what happens, the verifier starts its draft at once and says so
        (next_round_hit); the loop then sends no Verify, only the offers for the
        step after. The verifier's wait for the loop's round trip is gone from
        those steps. Where that wait is costly (next_round_lookup), the verifier
        also starts the steps no offer foresaw, with a draft it looks up itself."""
        index, verifier = None, None
        drafter: DrafterSession | None = None
        prediction = PredictionDrafter(request.prediction_token_ids) if request.prediction_token_ids else None
        usage = SpeculationUsage()  # immutable: each delta carries its own snapshot
        speculation = request.speculation
        k = speculation.num_speculative_tokens
        # Hybrid's drafter steps too: on copy-heavy output they are most of its steps.
        lookahead = (self._policy.next_round and speculation.uses_drafter
                     and not speculation.suffix_decoding_use_tree_spec)
        try:
            if self._drafter is not None and speculation.feeds_drafter:
                # Sent before prefill so the drafter indexes the prompt while the verifier prefills.
                drafter = await self._drafter.open(request, lookahead=lookahead)
            proposer = drafter if speculation.uses_drafter else None  # a head's output only feeds it
            index, verifier, result = await self._prefill(request)
            output = list(result.token_ids)
            offered: list[verifier_pb2.Continuation] = []  # for the step in flight
            adaptive = AdaptiveDraftLength(k) if self._policy.adaptive_draft_length else None
            acceptance = (RequestAcceptance(self._acceptance[speculation.drafter_method])
                          if self._policy.break_even and proposer is not None else None)
            hybrid = (HybridChoice(self._policy.draft_token_cost, HeadWorth(REQUEST_WEIGHT, self._head_worth.worth))
                      if speculation.method == "hybrid" else None)
            withheld: list[int] = []  # committed tokens not yet sent to the drafter
            while result.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                # Less than k while the verifier is busy: a big batch is compute-bound, so a
                # draft token costs what another sequence's token does.
                running = self._verifiers.num_in_flight(index)
                limit = self._policy.max_draft_tokens(running, adaptive.limit if adaptive else k)
                drafter_limit = self._policy.paying_draft_tokens(running, limit, acceptance)
                withheld += result.token_ids
                asked = time.perf_counter()
                drafted = step_drafted = _NO_DRAFT  # all the drafter drafted; its part for this step
                # A step with no drafter draft to verify does not ask for one: its tokens
                # go with the next request for a draft (or the last), which spares the
                # drafter's and the gateway's work per step where drafts do not pay.
                # Drafted before the tokens go out: a drafter that refuses the request makes it a 400.
                if drafter_limit > 0 or result.next_round_hit:
                    drafted = await _next_draft(proposer, withheld, result.committed_len)
                    withheld = []
                    step_drafted = step_part(drafted)
                drafter_seconds = time.perf_counter() - asked
                predicted = _predicted_draft(prediction, result, limit)
                ran_ahead = result.next_round_hit  # the verifier already verifies one of `offered`
                drafter_draft = cut(step_drafted, 0, drafter_limit)
                if ran_ahead and result.HasField("lookup_draft"):
                    source, draft = LOOKUP, result.lookup_draft
                elif ran_ahead:
                    source, draft = DRAFTER, offered_draft(offered, result.committed_len, result.token_ids[-1])
                elif limit == 0:  # a head's draft is not shortened here: only switched off
                    source, draft = NONE, _NO_DRAFT
                else:
                    source, draft = _pick_draft(speculation.method, predicted, drafter_draft, hybrid)
                drafted_step = lookahead and source in (DRAFTER, LOOKUP, NONE)  # NONE: the drafter had nothing
                offered = (continuations_after(draft, drafted, drafter_limit) if drafted_step and source != NONE
                           and limit > 0 else [])
                round_trip = self._round_trips[index]
                lookup_tokens = (drafter_limit if drafted_step and looks_up(self._policy.next_round_lookup, round_trip)
                                 else 0)
                sent = time.perf_counter()
                await _checked(_send_step(verifier, result, source, draft, ran_ahead, offered, lookup_tokens))
                # The last step's tokens go out (detokenized, streamed) while the verifier runs this one.
                yield _delta(result, speculation=usage)
                result = await _checked(verifier.answer())
                if offered or lookup_tokens:
                    self._metrics.record_next_round(offer_outcome(result))
                usage += _step_usage(result, source, ran_ahead)
                if source == HEAD:
                    worth = head_step_worth(result, self._policy.draft_token_cost)
                    self._head_worth.observe(worth)
                    if hybrid is not None:
                        hybrid.head.observe(worth)
                if source in (DRAFTER, LOOKUP):
                    if adaptive is not None:
                        adaptive.observe(result.num_draft_tokens, result.num_accepted_draft_tokens)
                    if acceptance is not None:
                        acceptance.observe(result.num_draft_tokens, result.num_accepted_draft_tokens)
                output += result.token_ids
                loss = (lookup_loss(list(drafter_draft.token_ids), result.num_accepted_draft_tokens,
                                    list(result.token_ids)) if source == LOOKUP else None)
                round_trip.observe_step(len(result.token_ids), loss)
                # The step after the prefill always waits, and a step the verifier started itself did not wait:
                # neither tells what a lookup would save (gateway/round_trip.py).
                self._record_step(result, source, drafter_seconds, time.perf_counter() - sent,
                                  round_trip if not ran_ahead and usage.verify_steps > 1 else None)
            if drafter is not None:  # the tokens it has not been sent: the last steps', or all of them
                unsent = withheld + list(result.token_ids) if proposer is not None else output
                self._finish_in_background(drafter, unsent, result.committed_len)
                drafter = None
            yield _delta(result, FINISH_REASON_NAMES[result.finish_reason], usage)
        except Unavailable:
            if index is not None:
                self._verifiers.mark_down(index)
            raise
        finally:
            if index is not None:
                verifier.close()
                self._verifiers.release(index)
            if drafter is not None:
                drafter.close()

    async def _prefill(self, request: GenerationRequest):
        """The prompt's first token, from a serving verifier. One found gone is
        marked down and the next tried: nothing has reached the client yet, so
        the request fails over unseen. Unavailable once none is left."""
        for _ in self._verifiers.addresses:
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

    def _record_step(self, result, source: str, drafter_seconds: float, verifier_seconds: float,
                     round_trip: RoundTrip | None) -> None:
        """Where a step's time went: waiting for the drafter, and for the
        verifier, split into its own time (forward pass included) and the rest,
        the network's. Metrics always; a debug log line per step; the wait into
        `round_trip` where the step measures it."""
        self._metrics.record_verify_step(result.num_draft_tokens, result.num_accepted_draft_tokens)
        times = StepTimes(drafter_seconds, verifier_seconds, result.step_seconds, result.forward_seconds,
                          result.head_draft_seconds)
        self._metrics.record_step_times(times)
        if round_trip is not None:
            round_trip.observe_wait(times.network + times.drafter_wait, times.forward)
        log.debug("verify_step", source=source, draft_tokens=result.num_draft_tokens,
                  accepted=result.num_accepted_draft_tokens, **times.milliseconds())

    def _finish_in_background(self, drafter: DrafterSession, committed: list[int], committed_len: int) -> None:
        task = asyncio.ensure_future(drafter.finish(committed, committed_len))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)


def _delta(result, finish_reason: str | None = None, speculation: SpeculationUsage | None = None) -> TokenDelta:
    logprobs = tuple(TokenLogprob(entry.logprob, tuple(zip(entry.top_token_ids, entry.top_logprobs)))
                     for entry in result.logprobs)
    return TokenDelta(list(result.token_ids), finish_reason, speculation, logprobs)


def _send_step(verifier, last, source: str, draft: common_pb2.Draft | None, ran_ahead: bool,
               offered: list[verifier_pb2.Continuation], lookup_tokens: int):
    """Sends a step's draft, or nothing when the verifier already runs it
    (`ran_ahead`), with `offered` continuations for the step after, and where
    none matches, a prompt lookup of up to `lookup_tokens` (0: wait)."""
    next_round = (verifier_pb2.NextRound(step_committed_len=last.committed_len, continuations=offered,
                                         lookup_tokens=lookup_tokens)
                  if offered or lookup_tokens else None)
    if ran_ahead:
        return verifier.send_offer(next_round)
    return verifier.send_verify(draft, use_head_draft=source == HEAD, next_round=next_round)


def _step_usage(result, source: str, ran_ahead: bool) -> SpeculationUsage:
    drafted, accepted = result.num_draft_tokens, result.num_accepted_draft_tokens
    return SpeculationUsage(drafted, accepted, 1, *((drafted, accepted) if source == PREDICTION else (0, 0)),
                            drafter_steps=int(source == DRAFTER), head_steps=int(source == HEAD),
                            next_round_steps=int(ran_ahead))


def _pick_draft(method: str, predicted: common_pb2.Draft | None, drafted: common_pb2.Draft,
                hybrid: HybridChoice | None) -> tuple[str, common_pb2.Draft | None]:
    """Which draft this step verifies, and its source. A predicted output wins
    while it lasts. Hybrid takes the draft expected to commit more tokens per
    unit of step time, the drafter's judged by its score, the head's by what
    its steps have committed in this request (head_step_worth). Arctic's rule compares the
    suffix score with the head draft's length, as if every head token were
    accepted and verification were free; on a CPU verifier neither holds, so
    that rule sends steps to long, unsure head drafts, and it needs the head's
    draft made at every step to know its length."""
    if predicted is not None:
        return PREDICTION, predicted
    if method in HEAD_METHODS or (hybrid is not None and hybrid.prefers_head(drafted)):
        return HEAD, None
    return (DRAFTER, drafted) if drafted.token_ids else (NONE, drafted)


def _predicted_draft(prediction: PredictionDrafter | None, last, max_tokens: int) -> common_pb2.Draft | None:
    """The predicted output's continuation, preferred to the drafter's: the client
    told us what it expects. None when the output has left the prediction."""
    if prediction is None:
        return None
    prediction.advance(last.token_ids)
    tokens = prediction.draft(max_tokens)
    return common_pb2.Draft(token_ids=tokens, source="prediction") if tokens else None


async def _next_draft(drafter: DrafterSession | None, new_tokens: list[int], committed_len: int) -> common_pb2.Draft:
    """A draft continuing the committed tokens, `new_tokens` the drafter has not
    seen yet; the verifier cuts it to what can still be committed."""
    if drafter is None or not drafter.alive:
        return _NO_DRAFT
    draft = await drafter.propose(new_tokens, committed_len)
    return _NO_DRAFT if draft is None else draft


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
