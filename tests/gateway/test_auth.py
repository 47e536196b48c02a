"""API keys (--api-key): the OpenAI API answers 401 with OpenAI's body and the
gRPC API UNAUTHENTICATED without a configured key; /health and /metrics stay
open; a key never travels on a command line."""

import argparse

import grpc
import openai
import pytest

from gateway.auth import Keyring
from gateway.client import AsyncGenerationClient
from gateway.config import ENV_PREFIX, GatewayConfig
from speclane.config import add_arguments, to_argv, to_env
from tests.gateway.fake_services import serve
from tests.gateway.test_client import HELLO, scripted
from tests.gateway.test_openai_api import CHAT, client_for, post

pytestmark = pytest.mark.anyio
KEYS = ("key-one", "key-two")


def test_bearer_keys_are_checked():
    keyring = Keyring.load(KEYS)
    assert not Keyring.load(())
    assert keyring.authenticate("Bearer key-two") and keyring.authenticate("bearer key-one")
    for header in (None, "", "Bearer", "Bearer key-three", "Basic key-one", "key-one", "Bearer key-one-and-more"):
        assert keyring.authenticate(header) is None, header


async def test_http_needs_a_key_but_health_and_metrics_do_not(ctx, engine):
    ctx.keyring = Keyring.load(KEYS)
    missing = await post(ctx, CHAT)
    wrong = await post(ctx, CHAT, headers={"Authorization": "Bearer nope"})
    right = await post(ctx, CHAT, headers={"Authorization": "Bearer key-one"})
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200 and len(engine.requests) == 1
    async with client_for(ctx) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401


async def test_the_openai_client_sends_its_key(ctx):
    ctx.keyring = Keyring.load(KEYS)
    async with client_for(ctx) as http:
        good = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="key-two", http_client=http, max_retries=0)
        bad = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="wrong", http_client=http, max_retries=0)
        assert (await good.chat.completions.create(**CHAT)).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(**CHAT)


async def test_grpc_needs_a_key(ctx):
    ctx.keyring = Keyring.load(KEYS)
    async with serve(scripted(ctx)) as address:
        async with AsyncGenerationClient(address, api_key="key-one") as client:
            assert (await client.generate(messages=HELLO, max_tokens=8)).token_ids
        async with AsyncGenerationClient(address, api_key="wrong") as client:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.generate(messages=HELLO, max_tokens=8)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_key_never_travels_on_a_command_line_or_in_help(monkeypatch):
    config = GatewayConfig(api_key=KEYS)
    assert "key-one" not in " ".join(to_argv(config)) and "key-one" not in repr(config)
    assert to_env(config, ENV_PREFIX) == {"SPECLANE_GATEWAY_API_KEY": "key-one,key-two"}
    monkeypatch.setenv("SPECLANE_GATEWAY_API_KEY", "key-one")
    parser = argparse.ArgumentParser()
    add_arguments(parser, GatewayConfig, ENV_PREFIX)
    assert "key-one" not in parser.format_help()
    assert parser.parse_args([]).api_key == ("key-one",)
