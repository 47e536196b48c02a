"""Two real verifier processes behind one gateway: a follow-up turn lands on
the verifier that holds its conversation's prefix (that verifier's prefix
cache says so), and with one verifier killed, new requests all succeed on the
other."""

import concurrent.futures
import time

import grpc
import pytest

from gateway.client import GenerationClient
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from tests.e2e.prompts import humaneval_messages, sharegpt_messages
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_verifiers(model_dir, tmp_path_factory):
    stack = start_stack(model_dir, tmp_path_factory.mktemp("routing"), num_verifiers=2)
    yield stack
    stack.stop()


def load(address: str) -> verifier_pb2.EngineLoad:
    with grpc.insecure_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=10)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_follow_up_turn_goes_to_the_verifier_holding_its_prefix(two_verifiers):
    first, second = (v.address for v in (two_verifiers.verifier, *two_verifiers.more_verifiers))
    conversation = humaneval_messages(1)[0]  # about 150 prompt tokens: two whole blocks
    with GenerationClient(two_verifiers.gateway.grpc_address) as client:
        # A long generation holds the first verifier, so the conversation starts on the second.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(client.generate, messages=sharegpt_messages(1)[0], max_tokens=160, ignore_eos=True,
                               temperature=0.0)
            wait_for(lambda: busy.done() or load(first).num_running == 1)
            reply = client.generate(messages=conversation, max_tokens=16, temperature=0.0)
            assert len(busy.result().token_ids) == 160
        before = load(first), load(second)
        assert before[1].prefix_cache_queries > 0  # the first turn ran on the second verifier
        # Both idle now: the least busy rule alone would pick the first.
        follow_up = [*conversation, {"role": "assistant", "content": reply.text},
                     {"role": "user", "content": "Now add a docstring."}]
        client.generate(messages=follow_up, max_tokens=8, temperature=0.0)
    after = load(first), load(second)
    assert after[0].prefix_cache_queries == before[0].prefix_cache_queries
    assert after[1].prefix_cache_hits - before[1].prefix_cache_hits >= 128


def test_with_one_verifier_killed_new_requests_all_succeed_on_the_other(two_verifiers):
    two_verifiers.kill("verifier")
    with GenerationClient(two_verifiers.gateway.grpc_address, retries=0) as client:
        # At once: the gateway learns the first is gone from a failed prefill, and fails over.
        runs = [client.generate(messages=messages, max_tokens=8, temperature=0.0)
                for messages in sharegpt_messages(4)]
    assert all(len(run.token_ids) > 0 for run in runs)
