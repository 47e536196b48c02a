"""The verifier's limits, through its real server (server.run): a draft of more
nodes than --max-draft-tokens is INVALID_ARGUMENT before any of it is copied,
tree parents must be a tree, and a gRPC message over the limit is
RESOURCE_EXHAUSTED, not a crash; the session goes on serving others."""

import asyncio
import os
import signal

import grpc
import pytest

from protos.conventions import MESSAGE_LIMIT_BYTES
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.speculation import MAX_SPECULATIVE_TOKENS
from verifier_service import server
from verifier_service.config import DEFAULT_MAX_DRAFT_TOKENS, VerifierConfig

from .test_service import prefill, session_error, verify, wait_serving

LIMIT = MAX_SPECULATIVE_TOKENS  # the lowest the flag allows
LONG = verifier_pb2.SamplingParams(max_new_tokens=100, ignore_eos=True)  # room for a draft of LIMIT tokens


def draft_of(count: int) -> list[int]:
    return [4 + i % 50 for i in range(count)]  # inside the tiny model's vocabulary of 64


def test_max_draft_tokens_defaults_above_what_a_request_may_ask_and_never_below_it(tiny_model_dir):
    assert VerifierConfig(model=tiny_model_dir).max_draft_tokens == DEFAULT_MAX_DRAFT_TOKENS >= MAX_SPECULATIVE_TOKENS
    with pytest.raises(ValueError, match="max_draft_tokens must be at least"):
        VerifierConfig(model=tiny_model_dir, max_draft_tokens=MAX_SPECULATIVE_TOKENS - 1)


def test_drafts_and_messages_over_the_limits_are_refused_and_serving_goes_on(tiny_model_dir):
    config = VerifierConfig(model=tiny_model_dir, address="127.0.0.1:0", device="cpu", threads=1,
                            max_draft_tokens=LIMIT)

    async def main():
        port = asyncio.get_running_loop().create_future()
        running = asyncio.ensure_future(server.run(config, ready=port.set_result))
        await asyncio.wait([port, running], return_when=asyncio.FIRST_COMPLETED)
        try:
            # A channel without our options: no limit on what it sends.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port.result()}") as channel:
                await wait_serving(channel)
                errors = {
                    "too many tokens": await session_error(channel, prefill(sampling=LONG),
                                                           verify(draft_of(LIMIT + 1))),
                    "too many parents": await session_error(channel, prefill(sampling=LONG),
                                                            verify(draft_of(3), parents=[-1] * (LIMIT + 1))),
                    "not a tree": await session_error(channel, prefill(sampling=LONG),
                                                      verify(draft_of(3), parents=[-1, 2, 0])),
                    "oversized": await session_error(channel, verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(
                        sequence_id="x" * (MESSAGE_LIMIT_BYTES + 1), prompt_token_ids=[5]))),
                }
                call = verifier_pb2_grpc.VerifierStub(channel).Session()
                await call.write(prefill(sampling=LONG))
                await call.read()
                await call.write(verify(draft_of(LIMIT)))  # exactly the limit: verified
                accepted = await call.read()
                call.cancel()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # serve() drains on SIGTERM
            await running
        return errors, accepted

    errors, accepted = asyncio.run(main())
    for name in ("too many tokens", "too many parents", "not a tree"):
        assert errors[name].code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert errors["too many tokens"].details() == (f"a draft may have at most {LIMIT} nodes (--max-draft-tokens); "
                                                   f"this one has {LIMIT + 1}")
    assert f"this one has {LIMIT + 1}" in errors["too many parents"].details()
    assert "must be -1 or the index of an earlier token" in errors["not a tree"].details()
    assert errors["oversized"].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert accepted.num_draft_tokens == LIMIT and accepted.token_ids
