"""gRPC session clients the propose/verify loop talks through: one bidirectional
stream per sequence to the verifier, and one to the drafter."""

import asyncio
import time
from collections.abc import Sequence

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.types import GenerationRequest, SpeculationSettings
from protos.common.v1 import common_pb2
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.grpc_server import CHANNEL_OPTIONS, request_metadata

log = structlog.get_logger()

_PROPOSER_METHODS = {"suffix": drafter_pb2.METHOD_SUFFIX, "ngram": drafter_pb2.METHOD_NGRAM}


class VerifierSession:
    """A sequence on a verifier: prefill once, then one verify per step."""

    def __init__(self, call):
        self._call = call

    async def _exchange(self, message: verifier_pb2.SessionRequest) -> verifier_pb2.SessionResponse:
        await self._call.write(message)
        response = await self._call.read()
        if response is grpc.aio.EOF:
            # The server ended the stream without an answer; its status says why.
            await self._call
            raise RuntimeError("verifier closed the session without a status")
        return response

    async def prefill(self, request: GenerationRequest) -> verifier_pb2.SessionResponse:
        sampling = verifier_pb2.SamplingParams(
            max_new_tokens=request.max_tokens,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
        )
        for name in ("temperature", "top_p", "top_k", "seed"):
            value = getattr(request, name)
            if value is not None:
                setattr(sampling, name, value)
        prefill = verifier_pb2.Prefill(
            sequence_id=request.request_id, prompt_token_ids=request.prompt_token_ids, sampling=sampling
        )
        return await self._exchange(verifier_pb2.SessionRequest(prefill=prefill))

    async def verify(self, draft: common_pb2.Draft) -> verifier_pb2.SessionResponse:
        return await self._exchange(verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(draft=draft)))

    def close(self) -> None:
        # Cancelling (rather than half-closing) frees the KV cache at once, also mid-generation.
        self._call.cancel()


class VerifierPool:
    """Verifiers serving the same model; each new sequence goes to the least busy one."""

    def __init__(self, addresses: tuple[str, ...]):
        self._channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
        self._stubs = [verifier_pb2_grpc.VerifierStub(c) for c in self._channels]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._in_flight = [0] * len(addresses)
        self.addresses = addresses

    def open(self, request_id: str) -> tuple[int, VerifierSession]:
        index = min(range(len(self._stubs)), key=self._in_flight.__getitem__)
        self._in_flight[index] += 1
        return index, VerifierSession(self._stubs[index].Session(metadata=request_metadata(request_id)))

    def release(self, index: int) -> None:
        self._in_flight[index] -= 1

    async def model_info(self) -> verifier_pb2.ModelInfo:
        return await self._stubs[0].GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=10)

    async def ready(self) -> bool:
        """True when at least one verifier reports SERVING."""
        for stub in self._health:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        return False

    async def wait_ready(self, poll_seconds: float = 0.5) -> None:
        while not await self.ready():
            await asyncio.sleep(poll_seconds)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class DrafterSession:
    """A sequence on the drafter. Any failure disables it for the rest of the
    sequence: the request goes on without speculation rather than failing."""

    def __init__(self, call, timeout_seconds: float, on_failure):
        self._call = call
        self._timeout = timeout_seconds
        self._on_failure = on_failure
        self.alive = True

    async def start(self, request: GenerationRequest) -> None:
        settings = request.speculation
        params = drafter_pb2.ProposerParams(
            method=_PROPOSER_METHODS[settings.method],
            num_speculative_tokens=settings.num_speculative_tokens,
            prompt_lookup_min=settings.prompt_lookup_min,
            prompt_lookup_max=settings.prompt_lookup_max,
            max_spec_factor=settings.suffix_decoding_max_spec_factor,
            min_token_prob=settings.suffix_decoding_min_token_prob,
            max_tree_depth=settings.suffix_decoding_max_tree_depth,
            use_tree_spec=settings.suffix_decoding_use_tree_spec,
        )
        start = drafter_pb2.Start(
            sequence_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            params=params, tenant=request.tenant,
        )
        await self._guard(self._call.write(drafter_pb2.SessionRequest(start=start)))

    async def propose(self, committed: Sequence[int], committed_len: int) -> common_pb2.Draft | None:
        """Commits the new tokens and returns the next draft, or None if the drafter failed."""
        step = drafter_pb2.Step(committed_token_ids=committed, committed_len=committed_len)

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
            self.alive = False
            self._call.cancel()
            self._on_failure(exc)
            return None


class DrafterClient:
    """Opens drafter sessions; after a failure it stops trying for a while so a
    dead drafter costs nothing but the missing speculation."""

    def __init__(self, address: str, timeout_seconds: float, retry_seconds: float = 5.0):
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self._timeout = timeout_seconds
        self._retry_seconds = retry_seconds
        self._down_until = 0.0
        self.address = address

    async def open(self, request: GenerationRequest) -> DrafterSession | None:
        if time.monotonic() < self._down_until:
            return None
        call = self._stub.Session(metadata=request_metadata(request.request_id, request.tenant))
        session = DrafterSession(call, self._timeout, self._mark_down)
        await session.start(request)
        return session if session.alive else None

    def _mark_down(self, exc: Exception) -> None:
        if time.monotonic() >= self._down_until:
            # Logged once per outage, not once per request.
            log.warning("drafter_unavailable", address=self.address, error=_describe(exc),
                        retry_in_seconds=self._retry_seconds)
        self._down_until = time.monotonic() + self._retry_seconds

    async def close(self) -> None:
        await self._channel.close()


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__


def speculation_enabled(settings: SpeculationSettings) -> bool:
    return settings.method in _PROPOSER_METHODS
