"""A router in front of several gateways, as users run one in front of vLLM: SGLang's
model gateway (`smg`) with its cache-aware policy, over two gateways that each verify
with a verifier of their own and draft with one shared drafter. A conversation's
later turn must reach the gateway, so the verifier, that holds its prefix: each
follow-up finds its first turn's tokens in the prefix cache."""

import concurrent.futures
import pathlib
import subprocess
import sys

import grpc
import openai
import pytest

from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.net import free_port, wait_http_ok
from speclane_cli.supervisor import die_with_parent
from tests.e2e.prompts import humaneval_messages
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e

SMG = pathlib.Path(sys.executable).with_name("smg")
CONVERSATIONS = 6


@pytest.fixture(scope="module")
def routed(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router")
    stack = start_stack(model_dir, log_dir, num_verifiers=2, gateway_per_verifier=True)
    port = free_port()
    workers = [f"http://127.0.0.1:{gateway.port}" for gateway in (stack.gateway, *stack.more_gateways)]
    router = subprocess.Popen([str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy",
                               "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                               "--worker-urls", *workers], stdout=(log_dir / "smg.log").open("wb"),
                              stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/v1/models", router, timeout=120)
        yield stack, f"http://127.0.0.1:{port}/v1"
    finally:
        router.terminate()
        router.wait(30)
        stack.stop()


def prefix_cache(address: str) -> tuple[int, int]:
    """A verifier's prompt tokens queried and found in its prefix cache, since it started."""
    with grpc.insecure_channel(address) as channel:
        load = verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=10)
    return load.prefix_cache_queries, load.prefix_cache_hits


def test_a_conversations_later_turn_reaches_the_verifier_holding_its_prefix(routed):
    stack, base_url = routed
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    conversations = humaneval_messages(CONVERSATIONS)  # about 150 prompt tokens each

    def turn(messages):
        return client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=8,
                                              temperature=0.0)

    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
        firsts = list(pool.map(turn, conversations))
    # The router spread the conversations: both verifiers prefilled some.
    verifiers = (stack.verifier, *stack.more_verifiers)
    assert all(queries > 0 for queries, _ in (prefix_cache(v.address) for v in verifiers))
    follow_ups = [[*messages, {"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "Now add a docstring."}]
                  for messages, first in zip(conversations, firsts)]
    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
        seconds = list(pool.map(turn, follow_ups))
    for first, second in zip(firsts, seconds):
        # Its first turn's prompt in whole blocks, not only the template's opening that every conversation shares.
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 64
