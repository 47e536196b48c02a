"""API keys with tenants (--api-keys-file): the file is read and checked once,
the tenant a request drafts in comes from its key and never from x-tenant-id
(the drafter sees it, through the real gateway loop and both front ends), a
key's own concurrency limit, and --protect-metrics."""

import asyncio
import dataclasses
import json

import grpc
import openai
import pytest

from gateway.auth import DEFAULT_TENANT, Keyring, key_id
from gateway.client import AsyncGenerationClient
from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.grpc_api import add_generation_servicer
from protos.conventions import TENANT_METADATA_KEY
from speclane.config import parse_config
from tests.gateway.fake_services import FakeDrafter, FakeVerifier, eventually, gateway, serve
from tests.gateway.fakes import make_context
from tests.gateway.test_client import HELLO
from tests.gateway.test_openai_api import CHAT, client_for

pytestmark = pytest.mark.anyio
KEY_A = "sk-alpha-5f0c1e9b2d7a4c38"
KEY_B = "sk-bravo-93ab61d0e4f27c55"
KEY_PLAIN = "sk-plain-0d1e2f3a4b5c6d7e"  # an --api-key key
ENTRIES = {KEY_A: {"tenant": "team-a", "max_concurrent_requests": 1}, KEY_B: {"tenant": "team-b"}}


def keys_file(tmp_path, entries=ENTRIES, name="keys.json", text: str | None = None) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(entries) if text is None else text)
    return str(path)


def openai_client(http, key: str, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, http_client=http, max_retries=0, **kwargs)


def test_a_keys_file_gives_each_key_its_tenant_and_limit(tmp_path):
    yaml_file = keys_file(tmp_path, name="keys.yaml", text=f"{KEY_A}:\n  tenant: team-a\n"
                                                          f"  max_concurrent_requests: 1\n{KEY_B}:\n")
    for path in (keys_file(tmp_path, {**ENTRIES, KEY_B: {}}), yaml_file):
        keyring = Keyring.load((KEY_PLAIN, KEY_A), path)
        a, b, plain = (keyring.authenticate(f"Bearer {key}") for key in (KEY_A, KEY_B, KEY_PLAIN))
        assert (a.tenant, a.max_concurrent_requests) == ("team-a", 1)  # the file wins over --api-key
        assert plain.tenant == DEFAULT_TENANT and plain.max_concurrent_requests is None
        # A key without a tenant gets one of its own, derived from the key but never the key.
        assert b.tenant == f"key-{key_id(KEY_B)}" and KEY_B not in b.tenant and b.max_concurrent_requests is None
        assert len({a.key_id, b.key_id, plain.key_id}) == len(keyring) == 3


@pytest.mark.parametrize("name, text, message", [
    ("keys.json", '{"' + KEY_A + '": {"tenant": }}', "not valid JSON"),
    ("keys.yaml", f"{KEY_A}: [unclosed\n", "not valid YAML"),
    ("keys.json", json.dumps({KEY_A: {"tenant": "a", "max_concurrent": 3}}), "entry 1: unknown setting(s)"),
    ("keys.json", json.dumps({KEY_B: {}, KEY_A: {"max_concurrent_requests": 0}}), "entry 2: max_concurrent_requests"),
    ("keys.json", json.dumps({KEY_A: {"max_concurrent_requests": True}}), "max_concurrent_requests"),
    ("keys.json", json.dumps({KEY_A: {"tenant": ""}}), "entry 1: tenant"),
    ("keys.json", json.dumps({KEY_A: {"tenant": "équipe"}}), "printable ASCII"),
    ("keys.json", json.dumps({KEY_A: ["team-a"]}), "must be a mapping"),
    ("keys.json", json.dumps({f"{KEY_A} x": {}}), "without spaces"),
    ("keys.json", json.dumps([KEY_A]), "must map each key"),
    ("keys.json", "{}", "at least one key"),
    ("keys.json", '{"' + KEY_A + '": {}, "' + KEY_A + '": {}}', "appears twice"),
    ("keys.yaml", f"{KEY_A}: {{}}\n{KEY_A}: {{}}\n", "appears twice"),
    ("keys.txt", json.dumps(ENTRIES), ".json, .yaml or .yml"),
], ids=["json", "yaml", "unknown", "zero-limit", "bool-limit", "empty-tenant", "non-ascii-tenant", "not-mapping",
        "spaced-key", "list", "empty", "json-duplicate", "yaml-duplicate", "suffix"])
def test_a_bad_keys_file_is_refused_with_a_message_that_never_shows_a_key(tmp_path, name, text, message):
    with pytest.raises(ValueError) as raised:
        GatewayConfig(api_keys_file=keys_file(tmp_path, name=name, text=text))
    assert message in str(raised.value) and KEY_A not in str(raised.value)


def test_the_gateway_does_not_start_with_a_bad_or_missing_keys_file(tmp_path, monkeypatch, capsys):
    for path in (keys_file(tmp_path, text=json.dumps({KEY_A: {"tenant": 7}})), str(tmp_path / "missing.json")):
        with pytest.raises(SystemExit) as exited:
            parse_config(GatewayConfig, ENV_PREFIX, ["--api-keys-file", path], "gateway")
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert "api_keys_file" in error and KEY_A not in error
    monkeypatch.setenv("SPECLANE_GATEWAY_API_KEYS_FILE", keys_file(tmp_path))
    config = parse_config(GatewayConfig, ENV_PREFIX, [], "gateway")
    assert config.keyring.authenticate(f"Bearer {KEY_A}").tenant == "team-a"
    assert KEY_A not in repr(config)


class TenantRecordingDrafter(FakeDrafter):
    """A fake drafter that records each session's tenant (Start.tenant) as it arrives."""

    def __init__(self):
        super().__init__()
        self.tenants: list[str] = []

    async def Sessions(self, request_iterator, context):
        async def recording():
            async for request in request_iterator:
                self.tenants += [entry.start.tenant for entry in request.entries if entry.HasField("start")]
                yield request

        async for response in super().Sessions(recording(), context):
            yield response


async def tenants_downstream(tokenizer, keyring: Keyring, key: str | None, claimed: str) -> list:
    """One HTTP (official client) and one gRPC request through the real gateway loop, each
    with `key` and claiming tenant `claimed`; what the drafter received."""
    drafter = TenantRecordingDrafter()
    async with gateway([FakeVerifier()], drafter) as gw:
        ctx = dataclasses.replace(make_context(tokenizer, gw.orchestrator), metrics=gw.metrics, keyring=keyring)
        async with client_for(ctx) as http:
            client = openai_client(http, key or "unused", default_headers={TENANT_METADATA_KEY: claimed})
            await client.chat.completions.create(**CHAT, max_tokens=8, temperature=0)
        async with serve(lambda server: add_generation_servicer(server, ctx)) as address, \
                AsyncGenerationClient(address, api_key=key, tenant=claimed) as grpc_client:
            await grpc_client.generate(messages=HELLO, max_tokens=8)
        await eventually(lambda: len(drafter.tenants) == 2)
    return drafter.tenants


async def test_with_keys_the_drafter_gets_the_keys_tenant_whatever_the_header_claims(tiny_tokenizer, tmp_path):
    keyring = Keyring.load(keys_file=keys_file(tmp_path))
    assert await tenants_downstream(tiny_tokenizer, keyring, KEY_B, "team-a") == ["team-b"] * 2
    assert await tenants_downstream(tiny_tokenizer, keyring, KEY_A, "team-a") == ["team-a"] * 2


async def test_api_key_keys_share_the_default_tenant_and_no_keys_trust_the_header(tiny_tokenizer):
    plain = await tenants_downstream(tiny_tokenizer, Keyring.load((KEY_PLAIN,)), KEY_PLAIN, "team-a")
    assert plain == [DEFAULT_TENANT] * 2
    trusted = await tenants_downstream(tiny_tokenizer, Keyring(), None, "team-a")
    assert trusted == ["team-a"] * 2


async def test_a_key_over_its_own_limit_gets_429_while_other_keys_go_on(ctx, engine, tmp_path):
    ctx.keyring = Keyring.load(keys_file=keys_file(tmp_path))
    engine.hold = asyncio.Event()
    async with client_for(ctx) as http:
        a, b = openai_client(http, KEY_A), openai_client(http, KEY_B)
        first = asyncio.create_task(a.chat.completions.create(**CHAT))
        await engine.started.wait()
        with pytest.raises(openai.RateLimitError) as refused:
            await a.chat.completions.create(**CHAT)
        assert "this API key is at its limit of 1 concurrent generations" in refused.value.body["message"]
        with pytest.raises(openai.RateLimitError):  # n=2 takes two of the key's slots
            await a.chat.completions.create(**CHAT, n=2)
        async with serve(lambda server: add_generation_servicer(server, ctx)) as address, \
                AsyncGenerationClient(address, api_key=KEY_A) as grpc_client:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await grpc_client.generate(messages=HELLO, max_tokens=8)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "API key is at its limit" in raised.value.details()
        engine.hold.set()
        assert (await b.chat.completions.create(**CHAT)).choices  # another key is not held back
        assert (await first).choices
        assert (await a.chat.completions.create(**CHAT)).choices  # the slot came back
    assert ctx.limiter.in_flight == 0


def test_protect_metrics_without_keys_is_refused():
    with pytest.raises(ValueError, match="protect_metrics needs API keys"):
        GatewayConfig(protect_metrics=True)
    assert GatewayConfig(protect_metrics=True, api_key=(KEY_PLAIN,)).protect_metrics


async def test_protect_metrics_puts_metrics_behind_a_key_but_never_health(ctx):
    ctx.keyring = Keyring.load((KEY_PLAIN,))
    async with client_for(ctx) as http:
        assert (await http.get("/metrics")).status_code == 200  # open by default
        ctx.protect_metrics = True
        refused = await http.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        allowed = await http.get("/metrics", headers={"Authorization": f"Bearer {KEY_PLAIN}"})
        assert allowed.status_code == 200 and "vllm:" in allowed.text
        assert (await http.get("/health")).status_code == 200
