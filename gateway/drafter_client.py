"""The drafter as the propose/verify loop sees it: one Drafter.Sessions stream
that the gateway's sequences share, and a client that rests a failing drafter
so that its outage costs speculation, never a request."""

import asyncio
import itertools
import time
from collections.abc import Sequence

import grpc
import structlog

from gateway.errors import InvalidRequest
from gateway.types import GenerationRequest
from protos.common.v1 import common_pb2
from protos.conventions import CHANNEL_OPTIONS
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.speculation import DrafterLimits, limits_from_proto, settings_to_proto
from speclane.tls import TlsFiles, aio_channel

log = structlog.get_logger()


class DrafterRefused(Exception):
    """The drafter ended a session with this status (a SessionsResponse entry with a code)."""

    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class DrafterStream:
    """The one Drafter.Sessions stream a gateway's sequences share: the entries its
    sequences send in one event-loop turn go out as one message (a verifier pass
    answers its sequences together, so their steps come together), and each answer
    goes back to the step that waits for it. A broken stream fails every waiting step."""

    def __init__(self, stub: drafter_pb2_grpc.DrafterStub):
        self._call = stub.Sessions()
        self._numbers = itertools.count()
        self._outbox: list[drafter_pb2.SessionsRequest.Entry] = []
        self._batches: asyncio.Queue = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future] = {}
        self._live: set[int] = set()  # sessions not ended here
        self._refused: dict[int, DrafterRefused] = {}  # refusals no step waited for, for the session's next one
        self.broken: BaseException | None = None
        self._tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    def open(self) -> int:
        """A new session's number on this stream."""
        number = next(self._numbers)
        self._live.add(number)
        return number

    def send(self, entry: drafter_pb2.SessionsRequest.Entry) -> None:
        if self.broken is not None:
            return
        self._outbox.append(entry)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    async def step(self, number: int, step: drafter_pb2.Step) -> common_pb2.Draft:
        """The drafter's answer to a session's step; raises DrafterRefused, or ConnectionError if the stream broke."""
        if number in self._refused:
            raise self._refused.pop(number)
        if self.broken is not None:
            raise ConnectionError(f"the drafter stream broke: {_describe(self.broken)}")
        future = asyncio.get_running_loop().create_future()
        self._waiting[number] = future
        self.send(drafter_pb2.SessionsRequest.Entry(session=number, step=step))
        try:
            return await future
        finally:
            self._waiting.pop(number, None)

    def forget(self, number: int) -> None:
        self._live.discard(number)
        self._refused.pop(number, None)

    def _flush(self) -> None:
        entries, self._outbox = self._outbox, []
        if entries:
            self._batches.put_nowait(drafter_pb2.SessionsRequest(entries=entries))

    async def _write(self) -> None:
        try:
            while True:  # one write at a time: a stream takes no concurrent writes
                await self._call.write(await self._batches.get())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader sees the stream's status and fails the steps
            self._break(exc)

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("the drafter ended the stream")
                for entry in response.entries:
                    future = self._waiting.get(entry.session)
                    if entry.code:
                        refused = DrafterRefused(_STATUS_CODES.get(entry.code, grpc.StatusCode.UNKNOWN), entry.detail)
                        if future is None:
                            if entry.session in self._live:  # for its next step; late ones for ended sessions go
                                self._refused[entry.session] = refused
                        elif not future.done():
                            future.set_exception(refused)
                    elif future is not None and not future.done():
                        future.set_result(entry.draft)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever ends the stream fails the steps waiting on it
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError(f"the drafter stream broke: {_describe(exc)}"))

    def close(self) -> None:
        """Ends the stream and every session on it (the drafter keeps what they taught its global tree)."""
        self._break(ConnectionError("the stream was closed"))
        self._call.cancel()
        for task in self._tasks:
            task.cancel()


class DrafterSession:
    """A sequence on the drafter, over the gateway's shared stream. Any failure disables
    it for the rest of the sequence: the request goes on without speculation rather than failing."""

    def __init__(self, stream: DrafterStream, timeout_seconds: float, on_failure):
        self._stream = stream
        self._number = stream.open()
        self._timeout = timeout_seconds
        self._on_failure = on_failure
        self.alive = True

    def start(self, request: GenerationRequest, num_lookahead_tokens: int = 0) -> None:
        start = drafter_pb2.Start(
            sequence_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            params=settings_to_proto(request.speculation), tenant=request.tenant,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        self._stream.send(drafter_pb2.SessionsRequest.Entry(session=self._number, start=start))

    async def propose(self, committed: Sequence[int], committed_len: int, max_spec_factor: float | None = None,
                      min_token_prob: float | None = None) -> common_pb2.Draft | None:
        """Commits the new tokens and returns the next draft (a suffix draft under this
        budget where given), or None if the drafter failed.

        Raises InvalidRequest if the drafter refused the request's settings.
        """
        if not self.alive:
            return None
        step = drafter_pb2.Step(committed_token_ids=committed, committed_len=committed_len,
                                max_spec_factor=max_spec_factor, min_token_prob=min_token_prob)
        try:
            return await asyncio.wait_for(self._stream.step(self._number, step), self._timeout)
        except DrafterRefused as refused:
            self._end()  # the drafter has ended it already; an end for it is ignored
            if refused.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"the drafter refused the speculation settings: {refused.detail}",
                                     "speculation") from None
            if refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A full drafter is not a dead one: this request goes on without drafts and
                # the next ones still ask, where a rest would cost every request its drafts.
                log.info("drafter_session_refused", reason=refused.detail)
            else:
                self._on_failure(refused)
        except Exception as exc:  # noqa: BLE001 - whatever breaks the drafter must not break the request
            self._end()
            self._on_failure(exc)
        return None

    async def finish(self, committed: list[int], committed_len: int) -> None:
        """Hands the last tokens over so the global tree learns the whole response, then ends."""
        if committed:
            await self.propose(committed, committed_len)
        self._end()

    def close(self) -> None:
        self._end()

    def _end(self) -> None:
        if self.alive:
            self._stream.send(drafter_pb2.SessionsRequest.Entry(session=self._number, end=drafter_pb2.End()))
        self.alive = False
        self._stream.forget(self._number)


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
        self._stream: DrafterStream | None = None  # opened with the first session, again once broken

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
        if self._stream is None or self._stream.broken is not None:
            self._stream = DrafterStream(self._stub)
        session = DrafterSession(self._stream, self._timeout, self._mark_down)
        session.start(request, min(k + 1, self.limits.max_speculative_tokens) if lookahead else 0)
        return session

    def _mark_down(self, exc: Exception) -> None:
        if time.monotonic() >= self._down_until:
            # Logged once per outage, not once per request.
            log.warning("drafter_unavailable", address=self.address, error=_describe(exc),
                        retry_in_seconds=self._retry_seconds)
        self._down_until = time.monotonic() + self._retry_seconds
        self.limits = None  # a drafter that comes back may have been reconfigured
        if self._stream is not None:  # a stuck drafter holds its stream: after the rest, a new one
            self._stream.close()

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        await self._channel.close()


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
