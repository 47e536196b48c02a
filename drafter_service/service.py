"""gRPC adapter of the drafter: `Drafter.Session` streams, converted to and
from SequenceProposer calls at the boundary."""

import asyncio
import math
import time

import grpc
import structlog

from drafter_service.config import DrafterConfig
from drafter_service.draft import Draft
from drafter_service.engine import DraftEngine, StepBudget, step_budget
from drafter_service.metrics import DrafterMetrics
from drafter_service.proposer import CommittedLengthMismatch, SequenceProposer
from protos.common.v1 import common_pb2
from protos.conventions import TENANT_METADATA_KEY
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.grpc_server import bind_request_id_from
from speclane.log import metadata_value
from speclane.speculation import info_to_proto, settings_from_proto

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name

log = structlog.get_logger()


def draft_to_proto(draft: Draft, committed_len: int) -> common_pb2.Draft:
    return common_pb2.Draft(
        token_ids=draft.token_ids,
        parents=() if draft.is_chain else draft.parents,  # empty means a chain
        confidences=draft.probs,
        score=draft.score,
        committed_len=committed_len,
        source=draft.source,
        step_len=draft.step_len,
        detours=[common_pb2.Detour(position=detour.position, token_id=detour.token, token_ids=detour.token_ids,
                                   confidences=detour.probs) for detour in draft.detours],
    )


def _has_negative(token_ids) -> bool:
    return any(token < 0 for token in token_ids)


def _step_budget(step: drafter_pb2.Step) -> StepBudget | None:
    """The step's suffix budget for the engine (the session's where a field is absent); None if out of range."""
    factor = step.max_spec_factor if step.HasField("max_spec_factor") else None
    min_prob = step.min_token_prob if step.HasField("min_token_prob") else None
    if (factor is not None and not (math.isfinite(factor) and factor > 0)) or (
            min_prob is not None and not 0 <= min_prob <= 1):
        return None
    return step_budget(factor, min_prob)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DraftEngine, config: DrafterConfig, metrics: DrafterMetrics):
        # The engine keys sessions by its own numbers, not the client's sequence
        # ids, so a retried or reused sequence id never collides with a session still winding down.
        self._engine = engine
        self._limits = config.limits
        self._info = info_to_proto(config.limits, config.max_cached_tokens, config.share_tenants)
        self._metrics = metrics
        # Together a memory bound: each open session holds a suffix tree over its tokens.
        self._max_sessions = config.max_sessions
        self._max_session_tokens = config.max_session_tokens
        self._open_sessions = 0

    async def GetInfo(self, request, context: grpc.aio.ServicerContext):
        return self._info

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, requests, code: grpc.StatusCode, detail: str) -> None:
        """Ends a session its start cannot open, once the client's next message (or its end) is in.
        A start has no reply, so the client hears of the refusal on its next write: sent at once,
        the status races that write, which grpc then fails with a client-side INTERNAL that hides
        the status (and a gateway takes a full drafter for a dead one, resting it for everyone)."""
        await anext(requests, None)
        await context.abort(code, detail)

    async def _admit(self, context: grpc.aio.ServicerContext, requests, start: drafter_pb2.Start) -> None:
        """Refuses a session beyond the limits with RESOURCE_EXHAUSTED, which costs its
        request only the drafts (INVALID_ARGUMENT would fail the request at the gateway)."""
        if self._open_sessions >= self._max_sessions:
            detail = f"the drafter has its maximum of {self._max_sessions} sessions open (--max-sessions)"
        elif len(start.prompt_token_ids) > self._max_session_tokens:
            detail = (f"the prompt has {len(start.prompt_token_ids)} tokens; a drafter session holds at most "
                      f"{self._max_session_tokens} (--max-session-tokens)")
        else:
            return
        log.warning("session_refused", sequence_id=start.sequence_id, reason=detail)
        await self._refuse(context, requests, grpc.StatusCode.RESOURCE_EXHAUSTED, detail)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        bind_request_id_from(context)
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be start")
        start = first.start
        try:
            settings = settings_from_proto(start.params, self._limits)
        except ValueError as exc:
            await self._refuse(context, requests, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if start.num_lookahead_tokens > self._limits.max_speculative_tokens:
            await self._refuse(context, requests, grpc.StatusCode.INVALID_ARGUMENT,
                               f"start.num_lookahead_tokens must be at most {self._limits.max_speculative_tokens}")
        if _has_negative(start.prompt_token_ids):
            await self._refuse(context, requests, grpc.StatusCode.INVALID_ARGUMENT,
                               "start.prompt_token_ids must not be negative")
        tenant = start.tenant or metadata_value(context.invocation_metadata(), TENANT_METADATA_KEY) or ""
        await self._admit(context, requests, start)
        proposer = SequenceProposer(self._engine, settings, tenant, start.num_lookahead_tokens)
        proposer.start(start.prompt_token_ids)
        log.info("session_start", sequence_id=start.sequence_id, tenant=tenant, method=settings.method,
                 prompt_tokens=len(start.prompt_token_ids), num_speculative_tokens=settings.num_speculative_tokens)
        steps = drafted = 0
        ended_by = "error"
        self._open_sessions += 1  # no await since _admit checked it
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind != "step":
                    detail = "start may only be sent once" if kind == "start" else "empty message"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)
                step = request.step
                if _has_negative(step.committed_token_ids):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "step.committed_token_ids must not be negative")
                budget = _step_budget(step)
                if budget is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "step.max_spec_factor must be > 0 and "
                                        "step.min_token_prob in [0, 1]")
                try:
                    proposer.commit(step.committed_token_ids, step.committed_len)
                except CommittedLengthMismatch as exc:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                if proposer.committed_len > self._max_session_tokens:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the session passed the drafter's "
                                        f"limit of {self._max_session_tokens} tokens (--max-session-tokens)")
                started = time.perf_counter()
                draft = await proposer.propose(budget)
                self._metrics.observe_step(draft, time.perf_counter() - started)
                steps += 1
                drafted += len(draft)
                yield drafter_pb2.SessionResponse(draft=draft_to_proto(draft, proposer.committed_len))
            ended_by = "stream_closed"  # half-closed, or cancelled with the stream ending first
        except asyncio.CancelledError:
            ended_by = "cancelled"
            raise
        finally:
            self._open_sessions -= 1
            proposer.end()
            log.info("session_end", sequence_id=start.sequence_id, tenant=tenant, ended_by=ended_by, steps=steps,
                     output_tokens=proposer.committed_len - len(start.prompt_token_ids), drafted_tokens=drafted)
