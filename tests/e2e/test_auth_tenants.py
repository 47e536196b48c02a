"""API keys with tenants across the three real processes: two keys of two
tenants (--api-keys-file); each tenant's responses feed only its own suffix
tree, whatever x-tenant-id a client sends; a body over --max-request-body-bytes
gets 413 from the real HTTP server; and no key reaches a log."""

import json
import urllib.request

import grpc
import openai
import pytest

from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.net import free_port, probe_http
from tests.e2e.stack import TEST_THREADS, Stack
from verifier_service.config import VerifierConfig

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
KEY_A = "sk-e2e-alpha-7c1f09d2b8e4a635"
KEY_B = "sk-e2e-bravo-2e8b4f61c0d9a377"
# An answer the model writes in its own words: its per-request tree (prompt and
# output so far) guesses little of it, a tree that saw it before guesses most.
MESSAGES = [{"role": "user", "content": "Write a short poem about a lighthouse keeper and the sea."}]
MAX_TOKENS = 64
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    """A stack of its own (its trees start empty), with two keys of two tenants."""
    work = tmp_path_factory.mktemp("auth-tenants")
    keys = work / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "team-a"}, KEY_B: {"tenant": "team-b"}}))
    drafter = DrafterConfig(address=f"127.0.0.1:{free_port()}")
    verifier = VerifierConfig(model=str(model_dir), model_name=MODEL, address=f"127.0.0.1:{free_port()}",
                              threads=TEST_THREADS)
    gateway = GatewayConfig(
        model=str(model_dir), served_model_name=MODEL, port=free_port(), grpc_address=f"127.0.0.1:{free_port()}",
        drafter_address=drafter.address, verifier_addresses=(verifier.address,),
        # The break-even cut learns how long drafts pay from all requests, so one tenant's could shorten
        # another's (lengths only), and the verifier's own lookups engage by timing; the accepted counts
        # below are compared exactly.
        speculative_config='{"method": "suffix", "num_speculative_tokens": 8}',
        speculation_debug='{"break_even": false, "lookup": "off"}',
        api_keys_file=str(keys),
        max_request_body_bytes=BODY_LIMIT, max_tokens_limit=MAX_TOKENS, protect_metrics=True,
        draft_timeout_ms=5000,  # a busy test host must not skip drafts: the counts below are compared exactly
        log_level="debug",  # the most a log line could say about a key
    )
    running = Stack(drafter, verifier, gateway, work)
    for name in ("drafter", "verifier", "gateway"):
        running.start_service(name)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def client(stack: Stack, key: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=120, **kwargs)


def ask(chat: openai.OpenAI):
    reply = chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    return reply.choices[0].message.content, reply.usage.model_extra["speculation"]["accepted_tokens"]


def cache_hits(stack: Stack) -> int:
    with grpc.insecure_channel(stack.verifier.address) as channel:
        load = verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=10)
    return load.prefix_cache_hits


def test_a_tenant_drafts_from_its_own_responses_and_never_from_anothers(stack):
    team_a = client(stack, KEY_A)
    # B names A's tenant: with keys, its key's tenant counts, never the header.
    team_b = client(stack, KEY_B, default_headers={"x-tenant-id": "team-a"})
    hits = [cache_hits(stack)]
    a_first_text, a_first = ask(team_a)
    hits.append(cache_hits(stack))
    a_again_text, a_again = ask(team_a)
    hits.append(cache_hits(stack))
    b_first_text, b_first = ask(team_b)
    hits.append(cache_hits(stack))
    b_again_text, b_again = ask(team_b)
    hits.append(cache_hits(stack))
    assert a_first_text == a_again_text == b_first_text == b_again_text  # greedy, lossless
    # The verifier's prefix cache is salted with the tenant: A's second prompt finds A's blocks, B's first
    # finds none of them (the same prompt), B's second finds B's.
    found = [after - before for before, after in zip(hits, hits[1:])]
    assert found[1] > 0 and found[2] == 0 and found[3] == found[1], found
    # A's second answer is drafted from A's first; B's first drafts as A's first did,
    # from its own prompt only; then B learns from its own answer.
    accepted = {"a_first": a_first, "a_again": a_again, "b_first": b_first, "b_again": b_again}
    assert a_again > a_first + MAX_TOKENS // 4, accepted
    assert b_first == a_first, accepted
    assert b_again > b_first + MAX_TOKENS // 4, accepted
    drafter_log = (stack.log_dir / "drafter.log").read_text()
    sessions = [json.loads(line) for line in drafter_log.splitlines() if '"session_start"' in line]
    assert [session["tenant"] for session in sessions] == ["team-a", "team-a", "team-b", "team-b"]
    assert '"tenant_header_ignored"' in (stack.log_dir / "gateway.log").read_text()


def test_a_cache_salt_keeps_a_requests_prefix_to_itself_within_its_tenant(stack):
    """vLLM's cache_salt: requests share prefix-cache blocks only with the same tenant and salt."""
    team_a = client(stack, KEY_A)

    def hits_of(salt: str) -> int:
        before = cache_hits(stack)
        team_a.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                       extra_body={"cache_salt": salt})
        return cache_hits(stack) - before

    # Team A's unsalted blocks of this prompt are cached (the test above); a salted request finds none,
    # the same salt again finds its own, another salt none.
    first, again, other = hits_of("session-1"), hits_of("session-1"), hits_of("session-2")
    assert first == 0 and again > 0 and other == 0, (first, again, other)
    for bad in ("", "a/b", "x" * 129):
        with pytest.raises(openai.BadRequestError) as refused:
            team_a.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                           extra_body={"cache_salt": bad})
        assert refused.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError) as refused:
        team_a.responses.create(model=MODEL, input="hi", max_output_tokens=4, extra_body={"cache_salt": "a@b"})
    assert refused.value.body["param"] == "cache_salt"


def test_without_a_key_requests_and_metrics_are_401_but_health_is_open(stack):
    with pytest.raises(openai.AuthenticationError):
        client(stack, "sk-not-a-key").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    root = stack.base_url.removesuffix("/v1")
    assert probe_http(f"{root}/health") == (True, "HTTP 200")
    assert probe_http(f"{root}/metrics") == (False, "HTTP 401")  # --protect-metrics
    keyed = urllib.request.Request(f"{root}/metrics", headers={"Authorization": f"Bearer {KEY_B}"})
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with no_proxy.open(keyed, timeout=10) as metrics:
        assert b"vllm:" in metrics.read()


def test_max_tokens_over_the_limit_is_400(stack):
    with pytest.raises(openai.BadRequestError, match=f"max_tokens must be at most {MAX_TOKENS}"):
        client(stack, KEY_A).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS + 1)


def test_a_body_over_the_limit_is_413_from_the_http_server(stack):
    too_big = [{"role": "user", "content": "x" * (BODY_LIMIT + 1)}]
    with pytest.raises(openai.APIStatusError) as refused:
        client(stack, KEY_A).chat.completions.create(model=MODEL, messages=too_big, max_tokens=4)
    assert refused.value.status_code == 413 and refused.value.body["code"] == "request_too_large"
    assert ask(client(stack, KEY_A))[0]  # the server goes on


def test_no_key_reaches_a_log(stack):
    for name in ("gateway", "drafter", "verifier"):
        text = (stack.log_dir / f"{name}.log").read_text()
        assert text and KEY_A not in text and KEY_B not in text, name
