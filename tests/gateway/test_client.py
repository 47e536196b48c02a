"""The gRPC clients (gateway/client.py), blocking and asyncio, against the real
Generate API servicer over a scripted generation, in this process."""

import asyncio
import dataclasses

import grpc
import pytest

from gateway.client import AsyncGenerationClient, GenerationClient, Usage
from gateway.grpc_api import GenerationServicer, add_generation_servicer
from gateway.reasoning import REASONING_PARSERS
from protos.gateway.v1 import gateway_pb2_grpc
from tests.gateway.fake_services import serve
from tests.gateway.fakes import COMPLETION, FAKE_CACHED_TOKENS, ScriptedEngine, make_context

pytestmark = pytest.mark.anyio
HELLO = [{"role": "user", "content": "Say hello"}]


def scripted(ctx):
    return lambda server: add_generation_servicer(server, ctx)


class FlakyGateway(gateway_pb2_grpc.GenerationServicer):
    """UNAVAILABLE for the first `failures` calls (a gateway with no verifier yet), then the real thing."""

    def __init__(self, ctx, failures: int):
        self.calls = 0
        self.failures = failures
        self._ctx = ctx

    def add_to(self, server):
        self._real = GenerationServicer(self._ctx)
        gateway_pb2_grpc.add_GenerationServicer_to_server(self, server)

    async def Generate(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier is serving right now")
        async for response in self._real.Generate(request, context):
            yield response


async def test_async_stream_and_generate(ctx, engine):
    async with serve(scripted(ctx)) as address, AsyncGenerationClient(address) as client:
        chunks = [chunk async for chunk in client.stream(messages=HELLO, max_tokens=64)]
        result = await client.generate(messages=HELLO, max_tokens=64)
    assert "".join(chunk.text for chunk in chunks) == COMPLETION == result.text
    assert all(chunk.finish_reason is None for chunk in chunks[:-1]) and chunks[-1].finish_reason == "stop"
    assert result.token_ids == engine.token_ids
    steps = -(-len(engine.token_ids) // engine.step_size)
    assert result.usage == Usage(len(engine.requests[0].prompt_token_ids), len(engine.token_ids),
                                 4 * steps, 2 * steps, steps, cached_prompt_tokens=FAKE_CACHED_TOKENS)


async def test_reasoning_comes_apart_from_the_text(tiny_tokenizer):
    # Two tokens a step: the <think> tags fall across steps, and each chunk still splits cleanly.
    engine = ScriptedEngine(tiny_tokenizer, "<think>Paris is in France.</think>\n\nIt is sunny.", step_size=2)
    ctx = dataclasses.replace(make_context(tiny_tokenizer, engine), reasoning_parser=REASONING_PARSERS["qwen3"])
    async with serve(scripted(ctx)) as address, AsyncGenerationClient(address) as client:
        chunks = [chunk async for chunk in client.stream(messages=HELLO, max_tokens=64)]
        result = await client.generate(messages=HELLO, max_tokens=64)
    assert "".join(chunk.reasoning for chunk in chunks) == "Paris is in France." == result.reasoning
    assert "".join(chunk.text for chunk in chunks) == "It is sunny." == result.text
    assert sum(bool(chunk.reasoning) for chunk in chunks) > 1  # streamed, not held to the end


async def test_blocking_client_with_tenant_and_request_id(ctx, engine):
    async with serve(scripted(ctx)) as address:
        def call():
            with GenerationClient(address, tenant="team-a", api_key="secret") as client:
                return client.generate(prompt="Hello", max_tokens=64, request_id="trace-7")

        result = await asyncio.to_thread(call)
    assert result.text == COMPLETION and result.finish_reason == "stop"
    assert (engine.requests[0].tenant, engine.requests[0].request_id) == ("team-a", "trace-7")


async def test_unavailable_before_any_token_is_retried(ctx):
    flaky = FlakyGateway(ctx, failures=2)
    async with serve(flaky.add_to) as address, AsyncGenerationClient(address, retries=3) as client:
        result = await client.generate(messages=HELLO, max_tokens=64)
    assert result.text == COMPLETION and flaky.calls == 3


async def test_retries_end_and_other_errors_are_not_retried(ctx):
    flaky = FlakyGateway(ctx, failures=5)
    async with serve(flaky.add_to) as address, AsyncGenerationClient(address, retries=1) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.generate(messages=HELLO, max_tokens=64)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and flaky.calls == 2
        flaky.failures = 0
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.generate(messages=HELLO, max_tokens=0)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and flaky.calls == 3


async def test_leaving_a_stream_early_cancels_the_generation(ctx, engine):
    engine.hold = asyncio.Event()  # the generation waits after its first step
    async with serve(scripted(ctx)) as address, AsyncGenerationClient(address) as client:
        async for _ in client.stream(messages=HELLO, max_tokens=64):
            break
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
    assert engine.aborted == [engine.requests[0].request_id]


async def test_the_deadline_covers_the_whole_call(ctx, engine):
    engine.hold = asyncio.Event()
    async with serve(scripted(ctx)) as address, AsyncGenerationClient(address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.generate(messages=HELLO, max_tokens=64, timeout=0.3)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_exactly_one_prompt_is_required():
    with pytest.raises(ValueError, match="exactly one"):
        next(GenerationClient("127.0.0.1:1").stream(prompt="a", messages=HELLO))
