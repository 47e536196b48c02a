"""The propose -> verify loop: one sequence's generation across the drafter and
a verifier. The gateway is the only service that talks to both."""

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from gateway.backends import DrafterClient, DrafterSession, VerifierPool, speculation_enabled
from gateway.metrics import GatewayMetrics
from gateway.serving import InvalidRequest, Overloaded
from gateway.types import GenerationRequest, SpeculationUsage, TokenDelta
from protos.common.v1 import common_pb2
from protos.conventions import FINISH_REASON_NAMES

log = structlog.get_logger()

_NO_DRAFT = common_pb2.Draft()


class Orchestrator:
    def __init__(self, verifiers: VerifierPool, drafter: DrafterClient | None, metrics: GatewayMetrics):
        self._verifiers = verifiers
        self._drafter = drafter
        self._metrics = metrics
        # Drafter sessions finishing in the background; kept so they are not garbage-collected.
        self._finishing: set[asyncio.Task] = set()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Yields each step's committed tokens; closing the generator aborts the sequence."""
        index, verifier = self._verifiers.open(request.request_id)
        drafter: DrafterSession | None = None
        usage = SpeculationUsage()
        try:
            if self._drafter is not None and speculation_enabled(request.speculation):
                # Sent before prefill so the drafter indexes the prompt while the verifier prefills.
                drafter = await self._drafter.open(request)
            result = await _checked(verifier.prefill(request))
            generated = len(result.token_ids)
            while result.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                yield TokenDelta(list(result.token_ids), speculation=usage)
                draft = await _next_draft(drafter, result, request.max_tokens - generated)
                result = await _checked(verifier.verify(draft))
                generated += len(result.token_ids)
                usage.verify_steps += 1
                usage.draft_tokens += len(draft.token_ids)
                usage.accepted_tokens += result.num_accepted_draft_tokens
                self._metrics.record_verify_step(len(draft.token_ids), result.num_accepted_draft_tokens)
            if drafter is not None:
                self._finish_in_background(drafter, list(result.token_ids), result.committed_len)
                drafter = None
            yield TokenDelta(list(result.token_ids), FINISH_REASON_NAMES[result.finish_reason], usage)
        finally:
            verifier.close()
            self._verifiers.release(index)
            if drafter is not None:
                drafter.close()

    def _finish_in_background(self, drafter: DrafterSession, committed: list[int], committed_len: int) -> None:
        task = asyncio.ensure_future(drafter.finish(committed, committed_len))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)


async def _next_draft(drafter: DrafterSession | None, last, remaining_tokens: int) -> common_pb2.Draft:
    """Asks for a draft continuing the committed tokens, trimmed to what can still be emitted."""
    if drafter is None or not drafter.alive:
        return _NO_DRAFT
    draft = await drafter.propose(last.token_ids, last.committed_len)  # copied once, into the Step
    if draft is None:
        return _NO_DRAFT
    # A verify step emits the accepted tokens plus one of the target's own. A
    # tree may hold more nodes than that: the verifier cuts it by depth.
    budget = max(remaining_tokens - 1, 0)
    if not draft.parents and len(draft.token_ids) > budget:
        del draft.token_ids[budget:]
        del draft.parents[budget:]
        del draft.confidences[budget:]
        del draft.proposals[budget:]
    return draft


async def _checked(call):
    """Maps the verifier's status codes to the gateway's client-facing errors."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequest(exc.details()) from None
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded(exc.details()) from None
        raise
