"""What one request may take of the gateway: max_tokens (--max-tokens-limit), a
prompt within the context (vLLM's 400 messages), the HTTP body size (413 before
any parsing), the gRPC message size, and a full drafter costing only drafts."""

import asyncio
import contextlib
import os
import signal

import grpc
import openai
import pytest

from gateway.client import AsyncGenerationClient
from gateway.grpc_api import add_generation_servicer
from protos.conventions import MESSAGE_LIMIT_BYTES
from protos.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from speclane import grpc_server
from tests.gateway.fake_services import FakeDrafter, FakeVerifier, collect, gateway, serve, tokens_of
from tests.gateway.fakes import MODEL_NAME
from tests.gateway.test_client import HELLO, scripted
from tests.gateway.test_openai_api import CHAT, client_for

pytestmark = pytest.mark.anyio


def openai_client(http) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


@contextlib.asynccontextmanager
async def grpc_client(ctx):
    async with serve(scripted(ctx)) as address, AsyncGenerationClient(address) as client:
        yield client


async def test_max_tokens_beyond_the_limit_is_refused_and_none_asked_gets_the_limit(ctx, engine):
    ctx.max_tokens_limit = 5
    async with client_for(ctx) as http:
        client = openai_client(http)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(**CHAT, max_tokens=6)
        assert refused.value.body["param"] == "max_tokens"
        assert refused.value.body["message"] == "max_tokens must be at most 5 on this server, got 6"
        await client.chat.completions.create(**CHAT, max_tokens=5)
        await client.chat.completions.create(**CHAT)
    async with grpc_client(ctx) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.generate(messages=HELLO, max_tokens=6)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 5" in raised.value.details()
    assert [request.max_tokens for request in engine.requests] == [5, 5]


async def test_a_prompt_beyond_the_context_is_400_with_vllms_message(ctx):
    async with client_for(ctx) as http:
        client = openai_client(http)
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model=MODEL_NAME, prompt=[5] * 300)
        with pytest.raises(openai.BadRequestError) as no_room:
            await client.completions.create(model=MODEL_NAME, prompt=[5] * 200, max_tokens=100)
    assert too_long.value.body["message"] == ("This model's maximum context length is 256 tokens. However, your "
                                              "request has 300 input tokens. Please reduce the length of the input "
                                              "messages.")
    assert no_room.value.body["message"] == ("'max_tokens' or 'max_completion_tokens' is too large: 100. This "
                                             "model's maximum context length is 256 tokens and your request has 200 "
                                             "input tokens (100 > 256 - 200).")


async def test_a_body_over_the_limit_is_413_whether_declared_or_streamed(ctx, engine):
    ctx.max_request_body_bytes = 4096
    pulled = 0

    async def upload():  # chunked: no Content-Length to go by
        nonlocal pulled
        for _ in range(100):
            pulled += 1
            yield b"x" * 1024

    async with client_for(ctx) as http:
        client = openai_client(http)
        with pytest.raises(openai.APIStatusError) as declared:
            await client.chat.completions.create(**{**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]})
        streamed = await http.post("/v1/chat/completions", content=upload(),
                                   headers={"Content-Type": "application/json"})
        assert (await client.chat.completions.create(**CHAT)).choices  # within the limit: served
    assert declared.value.status_code == 413
    assert declared.value.body == {"message": "The request body is larger than this server's limit of 4096 bytes",
                                   "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    # Refused at the chunk that passed the limit, never parsed (it is not even JSON).
    assert streamed.status_code == 413 and pulled == 5
    assert streamed.json()["error"]["code"] == "request_too_large"
    assert len(engine.requests) == 1


async def test_a_grpc_message_over_the_limit_is_resource_exhausted_and_serving_goes_on(ctx):
    # The Generate API on speclane's gRPC server, as gateway/server.py serves it.
    port = asyncio.get_running_loop().create_future()
    serving = asyncio.ensure_future(grpc_server.serve(
        address="127.0.0.1:0", add_servicers=lambda server: [add_generation_servicer(server, ctx)],
        ready=port.set_result))
    try:
        # A channel without our options: no limit on what it sends.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{await port}") as channel:
            stub = gateway_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in stub.Generate(gateway_pb2.GenerateRequest(text="x" * (MESSAGE_LIMIT_BYTES + 1))):
                    pass
            replies = [reply async for reply in stub.Generate(gateway_pb2.GenerateRequest(text="hi", max_tokens=4))]
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # serve() drains on SIGTERM
        await serving
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert replies and replies[-1].finish_reason


async def test_a_full_drafter_costs_a_request_its_drafts_and_nothing_else():
    drafter = FakeDrafter()
    drafter.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, 0)  # as the drafter refuses a session over its limits
    async with gateway([FakeVerifier()], drafter) as gw:
        refused = await collect(gw)
        drafter.fail = None
        served = await collect(gw)  # no rest: the next request asks the drafter again
    assert tokens_of(refused) == tokens_of(served)
    assert refused[-1].speculation.draft_tokens == 0 and served[-1].speculation.draft_tokens > 0
