"""The verifiers as the propose/verify loop sees them: one bidirectional
stream per sequence (prefill once, then one verify per step), and the pool
that picks a verifier for each new sequence."""

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.types import GenerationRequest
from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.grpc_server import CHANNEL_OPTIONS, request_metadata


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
