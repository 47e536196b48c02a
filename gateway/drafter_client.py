"""The drafter as the propose/verify loop sees it: one bidirectional stream per
sequence, and a client that rests a failing drafter so that its outage costs
speculation, never a request."""

import asyncio
import time
from collections.abc import Sequence

import grpc
import structlog

from gateway.errors import InvalidRequest
from gateway.types import GenerationRequest
from protos.common.v1 import common_pb2
from protos.conventions import CHANNEL_OPTIONS, request_metadata
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.speculation import DrafterLimits, limits_from_proto, settings_to_proto
from speclane.tls import TlsFiles, aio_channel

log = structlog.get_logger()


class DrafterSession:
    """A sequence on the drafter. Any failure disables it for the rest of the
    sequence: the request goes on without speculation rather than failing."""

    def __init__(self, call, timeout_seconds: float, on_failure):
        self._call = call
        self._timeout = timeout_seconds
        self._on_failure = on_failure
        self.alive = True

    async def start(self, request: GenerationRequest, num_lookahead_tokens: int = 0) -> None:
        start = drafter_pb2.Start(
            sequence_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            params=settings_to_proto(request.speculation), tenant=request.tenant,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        await self._guard(self._call.write(drafter_pb2.SessionRequest(start=start)))

    async def propose(self, committed: Sequence[int], committed_len: int, max_spec_factor: float | None = None,
                      min_token_prob: float | None = None) -> common_pb2.Draft | None:
        """Commits the new tokens and returns the next draft (a suffix draft under this
        budget where given), or None if the drafter failed.

        Raises InvalidRequest if the drafter refused the request's settings.
        """
        step = drafter_pb2.Step(committed_token_ids=committed, committed_len=committed_len,
                                max_spec_factor=max_spec_factor, min_token_prob=min_token_prob)

        async def exchange():
            await self._call.write(drafter_pb2.SessionRequest(step=step))
            response = await self._call.read()
            if response is grpc.aio.EOF:
                raise ConnectionError("drafter ended the session")
            return response.draft

        return await self._guard(exchange())

    async def finish(self, committed: list[int], committed_len: int) -> None:
        """Hands the last tokens over so the global tree learns the whole response, then ends."""
        if committed:
            await self.propose(committed, committed_len)
        if self.alive:
            await self._guard(self._call.done_writing())
        self._call.cancel()

    def close(self) -> None:
        self._call.cancel()

    async def _guard(self, awaitable):
        if not self.alive:
            awaitable.close()
            return None
        try:
            return await asyncio.wait_for(awaitable, self._timeout)
        except Exception as exc:  # noqa: BLE001 - whatever breaks the drafter must not break the request
            code, details = await self._status()
            self._end()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"the drafter refused the speculation settings: {details}",
                                     "speculation") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A full drafter is not a dead one: this request goes on without drafts and
                # the next ones still ask, where a rest would cost every request its drafts.
                log.info("drafter_session_refused", reason=details)
            else:
                self._on_failure(exc)
        return None

    async def _status(self) -> tuple[grpc.StatusCode | None, str]:
        """How the drafter ended the session, if it did. Its status may come before
        our next write, which then fails with a local error instead."""
        if self._call.done():
            return await self._call.code(), await self._call.details()
        return None, ""

    def _end(self) -> None:
        self.alive = False
        self._call.cancel()


class DrafterClient:
    """Opens drafter sessions; after a failure it stops trying for a while so a
    dead drafter costs nothing but the missing speculation. Knows the drafter's
    limits (its GetInfo) once it has reached it, to check requests against."""

    def __init__(self, address: str, timeout_seconds: float, retry_seconds: float = 5.0,
                 tls: TlsFiles = TlsFiles()):
        self._channel = aio_channel(address, tls, CHANNEL_OPTIONS)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self._timeout = timeout_seconds
        self._retry_seconds = retry_seconds
        self._down_until = 0.0
        self.address = address
        self.limits: DrafterLimits | None = None  # None until reached, and again after a failure

    async def refresh_limits(self) -> DrafterLimits | None:
        """Asks the drafter for its limits; None (and a rest) if it does not answer."""
        try:
            info = await self._stub.GetInfo(drafter_pb2.GetInfoRequest(), timeout=max(self._timeout, 1.0))
        except grpc.aio.AioRpcError as exc:
            self._mark_down(exc)
            return None
        self.limits = limits_from_proto(info)
        return self.limits

    async def open(self, request: GenerationRequest, lookahead: bool = False) -> DrafterSession | None:
        """A session drafting for `request`; with `lookahead`, each draft goes on
        past its step where the drafter sees further (Draft.step_len): the likely
        next token, then the next step's draft (for next-round drafts)."""
        if time.monotonic() < self._down_until:
            return None
        if self.limits is None and await self.refresh_limits() is None:
            return None
        k = request.speculation.num_speculative_tokens
        call = self._stub.Session(metadata=request_metadata(request.request_id, request.tenant))
        session = DrafterSession(call, self._timeout, self._mark_down)
        await session.start(request, min(k + 1, self.limits.max_speculative_tokens) if lookahead else 0)
        return session if session.alive else None

    def _mark_down(self, exc: Exception) -> None:
        if time.monotonic() >= self._down_until:
            # Logged once per outage, not once per request.
            log.warning("drafter_unavailable", address=self.address, error=_describe(exc),
                        retry_in_seconds=self._retry_seconds)
        self._down_until = time.monotonic() + self._retry_seconds
        self.limits = None  # a drafter that comes back may have been reconfigured

    async def close(self) -> None:
        await self._channel.close()


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
