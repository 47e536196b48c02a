"""The propose -> verify loop: one sequence's generation across the drafter and
a verifier. The gateway is the only service that talks to both."""

import asyncio
from collections.abc import AsyncIterator

import grpc

from gateway.drafter_client import DrafterClient, DrafterSession
from gateway.errors import InvalidRequest, Overloaded, Unavailable
from gateway.metrics import GatewayMetrics
from gateway.types import GenerationRequest, SpeculationUsage, TokenDelta
from gateway.verifier_pool import VerifierPool
from protos.common.v1 import common_pb2
from protos.conventions import FINISH_REASON_NAMES

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
        usage = SpeculationUsage()  # immutable: each delta carries its own snapshot
        try:
            if self._drafter is not None and request.speculation.uses_drafter:
                # Sent before prefill so the drafter indexes the prompt while the verifier prefills.
                drafter = await self._drafter.open(request)
            result = await _checked(verifier.prefill(request))
            while result.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                # Drafted before the tokens go out: a drafter that refuses the request makes it a 400.
                draft = await _next_draft(drafter, result)
                yield TokenDelta(list(result.token_ids), speculation=usage)
                result = await _checked(verifier.verify(draft))
                usage += SpeculationUsage(result.num_draft_tokens, result.num_accepted_draft_tokens, verify_steps=1)
                self._metrics.record_verify_step(result.num_draft_tokens, result.num_accepted_draft_tokens)
            if drafter is not None:
                self._finish_in_background(drafter, list(result.token_ids), result.committed_len)
                drafter = None
            yield TokenDelta(list(result.token_ids), FINISH_REASON_NAMES[result.finish_reason], usage)
        except Unavailable:
            self._verifiers.mark_down(index)
            raise
        finally:
            verifier.close()
            self._verifiers.release(index)
            if drafter is not None:
                drafter.close()

    def _finish_in_background(self, drafter: DrafterSession, committed: list[int], committed_len: int) -> None:
        task = asyncio.ensure_future(drafter.finish(committed, committed_len))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)


async def _next_draft(drafter: DrafterSession | None, last) -> common_pb2.Draft:
    """A draft continuing the committed tokens; the verifier cuts it to what can still be committed."""
    if drafter is None or not drafter.alive:
        return _NO_DRAFT
    draft = await drafter.propose(last.token_ids, last.committed_len)  # copied once, into the Step
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
