"""gRPC adapter of the drafter: `Drafter.Session` (a sequence per stream) and
`Drafter.Sessions` (a gateway's sequences on one stream), converted to and from
SequenceProposer calls at the boundary; both check starts and steps alike, and
draft a message's steps in one call to the core."""

import asyncio
import math
import time

import grpc
import structlog

from drafter_service.config import DrafterConfig
from drafter_service.engine import CORE_SOURCES, CoreDraft, DraftEngine, StepBudget, step_budget
from drafter_service.metrics import DrafterMetrics
from drafter_service.proposer import CommittedLengthMismatch, SequenceProposer, propose
from protos.common.v1 import common_pb2
from protos.conventions import TENANT_METADATA_KEY
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.grpc_server import bind_request_id_from
from speclane.log import metadata_value
from speclane.speculation import info_to_proto, settings_from_proto

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name

log = structlog.get_logger()


def fill_draft(message: common_pb2.Draft, draft: CoreDraft, committed_len: int) -> None:
    """Writes the core's draft into `message` in place (a message built apart and then set
    into its answer would be copied again)."""
    token_ids, parents, probs, score, _, source, step_len, detours = draft
    message.token_ids.extend(token_ids)
    if parents != list(range(-1, len(parents) - 1)):  # empty means a chain
        message.parents.extend(parents)
    message.confidences.extend(probs)
    message.score = score
    message.committed_len = committed_len
    message.source = CORE_SOURCES.get(source, "")
    message.step_len = step_len
    for position, token, tokens, detour_probs in detours:
        message.detours.add(position=position, token_id=token, token_ids=tokens, confidences=detour_probs)


def draft_to_proto(draft: CoreDraft, committed_len: int) -> common_pb2.Draft:
    message = common_pb2.Draft()
    fill_draft(message, draft, committed_len)
    return message


def _has_negative(token_ids) -> bool:
    return min(token_ids, default=0) < 0


def _step_budget(step: drafter_pb2.Step) -> StepBudget | None:
    """The step's suffix budget for the engine (the session's where a field is absent); None if out of range."""
    factor = step.max_spec_factor if step.HasField("max_spec_factor") else None
    min_prob = step.min_token_prob if step.HasField("min_token_prob") else None
    if (factor is not None and not (math.isfinite(factor) and factor > 0)) or (
            min_prob is not None and not 0 <= min_prob <= 1):
        return None
    return step_budget(factor, min_prob)


class Refused(Exception):
    """A start or step the drafter will not take: the gRPC status it ends the session with."""

    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


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

    def _open(self, start: drafter_pb2.Start, tenant: str) -> "_Open":
        """A session for `start`; raises Refused: INVALID_ARGUMENT for bad settings, RESOURCE_EXHAUSTED
        beyond the limits (which costs its request only the drafts)."""
        try:
            settings = settings_from_proto(start.params, self._limits)
        except ValueError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if start.num_lookahead_tokens > self._limits.max_speculative_tokens:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"start.num_lookahead_tokens must be at most {self._limits.max_speculative_tokens}")
        if _has_negative(start.prompt_token_ids):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "start.prompt_token_ids must not be negative")
        if self._open_sessions >= self._max_sessions:
            detail = f"the drafter has its maximum of {self._max_sessions} sessions open (--max-sessions)"
        elif len(start.prompt_token_ids) > self._max_session_tokens:
            detail = (f"the prompt has {len(start.prompt_token_ids)} tokens; a drafter session holds at most "
                      f"{self._max_session_tokens} (--max-session-tokens)")
        else:
            tenant = start.tenant or tenant
            proposer = SequenceProposer(self._engine, settings, tenant, start.num_lookahead_tokens)
            proposer.start(start.prompt_token_ids)
            self._open_sessions += 1
            log.info("session_start", sequence_id=start.sequence_id, tenant=tenant, method=settings.method,
                     prompt_tokens=len(start.prompt_token_ids),
                     num_speculative_tokens=settings.num_speculative_tokens)
            return _Open(start, proposer)
        log.warning("session_refused", sequence_id=start.sequence_id, reason=detail)
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, detail)

    def _close(self, session: "_Open", ended_by: str) -> None:
        self._open_sessions -= 1
        proposer, start = session.proposer, session.start
        proposer.end()
        log.info("session_end", sequence_id=start.sequence_id, tenant=proposer.tenant, ended_by=ended_by,
                 steps=session.steps, output_tokens=proposer.committed_len - len(start.prompt_token_ids),
                 drafted_tokens=session.drafted)

    def _commit(self, proposer: SequenceProposer, step: drafter_pb2.Step) -> StepBudget:
        """Commits a step's tokens; returns its suffix budget. Raises Refused."""
        if _has_negative(step.committed_token_ids):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "step.committed_token_ids must not be negative")
        budget = _step_budget(step)
        if budget is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "step.max_spec_factor must be > 0 and step.min_token_prob in [0, 1]")
        try:
            proposer.commit(step.committed_token_ids, step.committed_len)
        except CommittedLengthMismatch as exc:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        if proposer.committed_len > self._max_session_tokens:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the session passed the drafter's limit of "
                          f"{self._max_session_tokens} tokens (--max-session-tokens)")
        return budget

    def _draft(self, stepping: list[tuple["_Open", StepBudget]], messages: list[common_pb2.Draft]) -> None:
        """Drafts a message's steps in one call to the core, each into its answer's message."""
        if not stepping:
            return
        started = time.perf_counter()
        drafts = propose(self._engine, [(session.proposer, budget) for session, budget in stepping])
        self._metrics.observe_batch(drafts, time.perf_counter() - started)
        for (session, _), draft, message in zip(stepping, drafts, messages):
            session.steps += 1
            session.drafted += len(draft[0])
            fill_draft(message, draft, session.proposer.committed_len)

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, requests, refused: Refused) -> None:
        """Ends a session its start cannot open, once the client's next message (or its end) is in.
        A start has no reply, so the client hears of the refusal on its next write: sent at once,
        the status races that write, which grpc then fails with a client-side INTERNAL that hides
        the status (and a gateway takes a full drafter for a dead one, resting it for everyone)."""
        await anext(requests, None)
        await context.abort(refused.code, refused.detail)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        bind_request_id_from(context)
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be start")
        start = first.start
        try:
            session = self._open(start, metadata_value(context.invocation_metadata(), TENANT_METADATA_KEY) or "")
        except Refused as refused:
            await self._refuse(context, requests, refused)
        ended_by = "error"
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind != "step":
                    detail = "start may only be sent once" if kind == "start" else "empty message"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)
                try:
                    budget = self._commit(session.proposer, request.step)
                except Refused as refused:
                    await context.abort(refused.code, refused.detail)
                response = drafter_pb2.SessionResponse()
                self._draft([(session, budget)], [response.draft])
                yield response
            ended_by = "stream_closed"  # half-closed, or cancelled with the stream ending first
        except asyncio.CancelledError:
            ended_by = "cancelled"
            raise
        finally:
            self._close(session, ended_by)

    async def Sessions(self, request_iterator, context: grpc.aio.ServicerContext):
        """Many sequences' sessions on one stream: each message's steps drafted in one batch, answered
        in one message. A refused start or step ends its session with an entry saying why."""
        bind_request_id_from(context)
        tenant = metadata_value(context.invocation_metadata(), TENANT_METADATA_KEY) or ""
        sessions: dict[int, _Open] = {}

        def close(number: int, ended_by: str) -> None:
            session = sessions.pop(number, None)
            if session is not None:
                self._close(session, ended_by)

        ended_by = "error"
        try:
            async for request in request_iterator:
                response, stepping = drafter_pb2.SessionsResponse(), {}  # stepping: number -> (session, budget)
                for entry in request.entries:
                    try:
                        kind = entry.WhichOneof("kind")
                        if kind == "start":
                            if entry.session in sessions:
                                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "start may only be sent once")
                            sessions[entry.session] = self._open(entry.start, tenant)
                        elif kind == "step":
                            session = sessions.get(entry.session)
                            if session is None:
                                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a step of no open session")
                            if entry.session in stepping:
                                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "one step per session per message")
                            stepping[entry.session] = (session, self._commit(session.proposer, entry.step))
                        elif kind == "end":
                            close(entry.session, "ended")
                        else:
                            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "empty entry")
                    except Refused as refused:
                        close(entry.session, "refused")
                        response.entries.add(session=entry.session, code=refused.code.value[0], detail=refused.detail)
                # A step whose session ended later in the message (a request cancelled as it stepped) is not
                # drafted: nothing waits for it.
                live = [(number, step) for number, step in stepping.items() if sessions.get(number) is step[0]]
                self._draft([step for _, step in live], [response.entries.add(session=number).draft
                                                         for number, _ in live])
                if response.entries:
                    yield response
            ended_by = "stream_closed"
        except asyncio.CancelledError:
            ended_by = "cancelled"
            raise
        finally:
            for number in list(sessions):
                close(number, ended_by)


class _Open:
    """An open session: its start, its proposer, and its counts for the log line that ends it."""

    def __init__(self, start: drafter_pb2.Start, proposer: SequenceProposer):
        self.start, self.proposer = start, proposer
        self.steps = self.drafted = 0
