"""The gRPC service in-process on port 0, through speclane's serve() and a
real channel."""

import asyncio
import contextlib
import os
import pathlib
import signal

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.common.v1 import common_pb2
from protos.conventions import CHANNEL_OPTIONS
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.grpc_server import serve
from verifier_service import server
from verifier_service.async_engine import AsyncEngine
from verifier_service.config import DEFAULT_MAX_DRAFT_TOKENS, VerifierConfig
from verifier_service.device import cpu_has_native_bf16
from verifier_service.draft_cost import BATCH_SIZES
from verifier_service.model_runner import ModelRunner
from verifier_service.prompt_lookup import lookup_draft
from verifier_service.sequence import Draft
from verifier_service.service import VerifierServicer, add_to_server, params_from_proto

from .conftest import GENERATION_EOS, MAX_CONTEXT, VOCAB, make_engine

PROMPT = [5, 17, 9, 40, 22, 8, 31]
SERVICE = "speclane.verifier.v1.Verifier"
OK_SAMPLING = verifier_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True)


@contextlib.asynccontextmanager
async def running_verifier(model_dir: str, warm: asyncio.Event | None = None, **engine_args):
    """Serves the verifier on port 0; yields (channel, engine). `warm` holds the warm-up back."""
    def load():
        return make_engine(ModelRunner(model_dir, "cpu", torch.float32), **engine_args)

    engine = AsyncEngine(load, threads=1)

    async def warmup():
        if warm is not None:
            await warm.wait()
        await engine.start()

    async def shutdown():
        await engine.stop()

    port = asyncio.get_running_loop().create_future()
    serving = asyncio.ensure_future(serve(
        address="127.0.0.1:0",
        add_servicers=lambda s: add_to_server(s, VerifierServicer(engine, "tiny", model_dir)),
        warmup=warmup, on_shutdown=shutdown, ready=port.set_result,
    ))
    await asyncio.wait([port, serving], return_when=asyncio.FIRST_COMPLETED)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port.result()}", options=CHANNEL_OPTIONS) as channel:
            yield channel, engine
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # serve() drains on SIGTERM
        await serving


async def health(channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
    return response.status


async def wait_serving(channel) -> None:
    for _ in range(200):
        if await health(channel) == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never became SERVING")


def prefill(prompt=PROMPT, sampling=OK_SAMPLING) -> verifier_pb2.SessionRequest:
    return verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(
        sequence_id="seq-1", prompt_token_ids=prompt, sampling=sampling))


def verify(tokens=(), **draft_fields) -> verifier_pb2.SessionRequest:
    return verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(
        draft=common_pb2.Draft(token_ids=tokens, **draft_fields)))


async def session_error(channel, *requests) -> grpc.aio.AioRpcError:
    """Sends `requests` on one session and returns the error that ends it."""
    call = verifier_pb2_grpc.VerifierStub(channel).Session()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        for request in requests:
            await call.write(request)
            await call.read()
    return caught.value


def plain_greedy(engine, prompt: list[int], sampling: verifier_pb2.SamplingParams) -> list[int]:
    """The engine's own tokens for the prompt, decoded without drafts: what a session must give."""
    seq = engine.open("ref", prompt, params_from_proto(verifier_pb2.Prefill(sampling=sampling)))
    tokens = engine.prefill(seq).token_ids
    while not seq.finished:
        tokens += engine.verify(seq, Draft()).token_ids
    return tokens


async def prefilled_session(channel, prompt: list[int], sampling: verifier_pb2.SamplingParams):
    """A session on the serving verifier, past its prefill's answer."""
    await wait_serving(channel)
    call = verifier_pb2_grpc.VerifierStub(channel).Session()
    await call.write(prefill(prompt, sampling))
    await call.read()
    return call


def test_round_trip_matches_the_engine(tiny_model_dir, engine):
    expected = plain_greedy(engine, PROMPT, OK_SAMPLING)

    async def main():
        async with running_verifier(tiny_model_dir) as (channel, async_engine):
            await wait_serving(channel)
            call = verifier_pb2_grpc.VerifierStub(channel).Session()
            await call.write(prefill())
            first = await call.read()
            assert list(first.token_ids) == expected[:1]
            assert first.committed_len == len(PROMPT) + 1
            assert first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
            await call.write(verify(expected[1:4] + [wrong(expected[4])], committed_len=len(PROMPT) + 1))
            step = await call.read()
            assert list(step.token_ids) == expected[1:5]
            assert step.num_accepted_draft_tokens == 3
            assert step.committed_len == len(PROMPT) + 5
            await call.write(verify(expected[5:]))
            last = await call.read()
            assert list(last.token_ids) == expected[5:]
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            await call.write(verify())
            with pytest.raises(grpc.aio.AioRpcError) as finished:
                await call.read()
            assert finished.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert await async_engine.num_live() == 0

    asyncio.run(main())


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


def next_round(step_committed_len: int, *continuations: tuple[int, list[int], int],
               lookup_tokens: int = 0, run_ahead: bool = False) -> verifier_pb2.SessionRequest:
    """Offers (bonus token, draft, draft's committed_len) continuations for the step starting at that length."""
    return verifier_pb2.SessionRequest(next_round=verifier_pb2.NextRound(
        step_committed_len=step_committed_len, lookup_tokens=lookup_tokens, run_ahead=run_ahead, continuations=[
            verifier_pb2.Continuation(bonus_token_id=bonus, draft=common_pb2.Draft(token_ids=draft, committed_len=at))
            for bonus, draft, at in continuations]))


def test_a_next_round_offer_that_matches_runs_without_a_verify_and_a_miss_waits_for_one(tiny_model_dir, engine):
    expected = plain_greedy(engine, PROMPT, OK_SAMPLING)
    start = len(PROMPT) + 1  # after the prefill's token

    async def main():
        async with running_verifier(tiny_model_dir) as (channel, async_engine):
            await wait_serving(channel)
            call = verifier_pb2_grpc.VerifierStub(channel).Session()
            await call.write(prefill())
            await call.read()
            # Two outcomes offered; the step accepts its 3 tokens and the target's next is expected[4].
            # Offered before its Verify (named by the length the step starts from): sent after it, a
            # busy machine can finish the step before the offer is read, and the offer would miss.
            await call.write(next_round(start, (wrong(expected[4]), [1, 2], start + 4),
                                        (expected[4], expected[5:7], start + 4)))
            await call.write(verify(expected[1:4], committed_len=start))
            step = await call.read()
            assert list(step.token_ids) == expected[1:5] and step.next_round_hit
            ran_ahead = await call.read()  # no Verify sent
            assert list(ran_ahead.token_ids) == expected[5:8] and ran_ahead.num_accepted_draft_tokens == 2
            assert ran_ahead.finish_reason == common_pb2.FINISH_REASON_LENGTH and not ran_ahead.next_round_hit

            call.cancel()
            call = verifier_pb2_grpc.VerifierStub(channel).Session()
            await call.write(prefill())
            await call.read()
            await call.write(verify(expected[1:3] + [wrong(expected[3])], committed_len=start))
            await call.write(next_round(start, (expected[4], expected[5:7], start + 4)))
            missed = await call.read()  # the draft was not accepted in full: the offer does not apply
            assert list(missed.token_ids) == expected[1:4] and not missed.next_round_hit
            await call.write(next_round(start, (expected[4], expected[5:7], start + 3)))  # late: ignored
            await call.write(verify(expected[4:6], committed_len=start + 3))
            step = await call.read()
            assert list(step.token_ids) == expected[4:7] and not step.next_round_hit
            await call.write(verify([]))
            assert list((await call.read()).token_ids) == expected[7:8]
            call.cancel()
            for _ in range(100):  # the verifier frees a cancelled session's sequence soon after
                if await async_engine.num_live() == 0:
                    break
                await asyncio.sleep(0.01)
            assert await async_engine.num_live() == 0

    asyncio.run(main())


def test_a_verify_carrying_its_next_round_runs_the_offer_that_matches_without_another_message(tiny_model_dir,
                                                                                            engine):
    """The gateway's form: the offers ride in the Verify, so they are there before its step ends."""
    expected = plain_greedy(engine, PROMPT, OK_SAMPLING)
    start = len(PROMPT) + 1

    async def main():
        async with running_verifier(tiny_model_dir) as (channel, _):
            call = await prefilled_session(channel, PROMPT, OK_SAMPLING)
            request = verify(expected[1:4], committed_len=start)
            request.verify.next_round.CopyFrom(next_round(start, (expected[4], expected[5:7], start + 4)).next_round)
            await call.write(request)
            step = await call.read()
            assert list(step.token_ids) == expected[1:5] and step.next_round_hit
            ran_ahead = await call.read()  # no other message sent
            assert list(ran_ahead.token_ids) == expected[5:8] and ran_ahead.num_accepted_draft_tokens == 2

    asyncio.run(main())


def test_where_no_offer_matches_a_next_round_with_lookups_runs_the_verifiers_own_draft(tiny_model_dir, engine):
    prompt = list(range(VOCAB))  # every token occurs in it, so a lookup always finds a match
    sampling = verifier_pb2.SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = plain_greedy(engine, prompt, sampling)
    start = len(prompt) + 1
    looked_up = lookup_draft(prompt + expected[:5], 4)
    assert looked_up

    async def main():
        async with running_verifier(tiny_model_dir) as (channel, _):
            call = await prefilled_session(channel, prompt, sampling)
            # The only continuation offered expects another bonus token: it misses.
            await call.write(next_round(start, (wrong(expected[4]), [1, 2], start + 4), lookup_tokens=4))
            await call.write(verify(expected[1:4], committed_len=start))
            step = await call.read()
            assert list(step.token_ids) == expected[1:5] and step.next_round_hit
            assert list(step.lookup_draft.token_ids) == looked_up and step.lookup_draft.committed_len == start + 4
            ran_ahead = await call.read()  # no Verify sent: the looked-up draft verified, greedy output unchanged
            accepted = ran_ahead.num_accepted_draft_tokens
            assert list(ran_ahead.token_ids) == expected[5:6 + accepted]
            assert ran_ahead.num_draft_tokens == len(looked_up) and not ran_ahead.HasField("lookup_draft")

    asyncio.run(main())


def test_a_next_round_that_runs_ahead_decodes_the_next_step_without_waiting_for_a_verify(tiny_model_dir, engine):
    """Plain decoding's offer, "go on without a draft": the step after the verified one runs at once, and
    the tokens are plain greedy decoding's."""
    prompt = [3, 5, 7, 9, 11]
    sampling = verifier_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = plain_greedy(engine, prompt, sampling)

    async def main():
        async with running_verifier(tiny_model_dir) as (channel, _):
            call = await prefilled_session(channel, prompt, sampling)
            await call.write(next_round(len(prompt) + 1, run_ahead=True))
            await call.write(verify([], committed_len=len(prompt) + 1))
            step = await call.read()
            assert list(step.token_ids) == expected[1:2] and step.next_round_hit
            assert not step.HasField("lookup_draft")
            ran_ahead = await call.read()  # no Verify sent
            assert list(ran_ahead.token_ids) == expected[2:3] and ran_ahead.num_draft_tokens == 0

    asyncio.run(main())


BAD_SESSIONS = {
    "verify first": ([verify([1])], "first message of a session must be prefill"),
    "empty prompt": ([prefill(prompt=[])], "empty"),
    "token out of range": ([prefill(prompt=[1, VOCAB])], "outside the vocabulary"),
    "prompt too long": ([prefill(prompt=[1] * MAX_CONTEXT)], "no room"),
    "max_new_tokens 0": ([prefill(sampling=verifier_pb2.SamplingParams())], "max_new_tokens"),
    "negative temperature": ([prefill(sampling=verifier_pb2.SamplingParams(max_new_tokens=4, temperature=-1))],
                             "temperature"),
    "top_p 0": ([prefill(sampling=verifier_pb2.SamplingParams(max_new_tokens=4, top_p=0))], "top_p"),
    "top_p above 1": ([prefill(sampling=verifier_pb2.SamplingParams(max_new_tokens=4, top_p=1.5))], "top_p"),
    "negative top_k": ([prefill(sampling=verifier_pb2.SamplingParams(max_new_tokens=4, top_k=-1))], "top_k"),
    "tree draft out of order": ([prefill(), verify([1, 2], parents=[-1, 1])], "index of an earlier token"),
    "proposals mismatch": ([prefill(), verify([1, 2], proposals=[common_pb2.TokenDistribution(
        token_ids=[1], probs=[1.0])])], "proposal distributions"),
    "second prefill": ([prefill(), prefill()], "every message must be verify"),
    "too many continuations": ([prefill(), next_round(8, *[(1, [2], 10)] * 9)], "at most 8 continuations"),
    "continuation without its length": ([prefill(), next_round(8, (1, [2], 0))], "needs its committed_len"),
    "continuation too long": ([prefill(), next_round(8, (1, [2] * (DEFAULT_MAX_DRAFT_TOKENS + 1), 10))], "at most"),
    "lookup too long": ([prefill(), next_round(8, lookup_tokens=DEFAULT_MAX_DRAFT_TOKENS + 1)], "look up at most"),
    "bad offer in a verify": ([prefill(), verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(
        next_round=next_round(8, *[(1, [2], 10)] * 9).next_round))], "at most 8 continuations"),
}


def test_invalid_sessions_are_refused(tiny_model_dir):
    async def main():
        async with running_verifier(tiny_model_dir) as (channel, engine):
            await wait_serving(channel)
            for name, (requests, message) in BAD_SESSIONS.items():
                error = await session_error(channel, *requests)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert message in error.details(), name
            assert await engine.num_live() == 0

    asyncio.run(main())


def test_health_waits_for_warm_up_and_cancel_frees_the_sequence(tiny_model_dir):
    async def main():
        warm = asyncio.Event()
        async with running_verifier(tiny_model_dir, warm) as (channel, engine):
            assert await health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            error = await session_error(channel, prefill())
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            warm.set()
            await wait_serving(channel)
            call = verifier_pb2_grpc.VerifierStub(channel).Session()
            await call.write(prefill())
            await call.read()
            assert await engine.num_live() == 1
            call.cancel()
            for _ in range(100):
                if await engine.num_live() == 0:
                    break
                await asyncio.sleep(0.01)
            assert await engine.num_live() == 0

    asyncio.run(main())


def test_server_run_serves_model_info_and_tokenizer_files(tiny_model_dir):
    config = VerifierConfig(model=tiny_model_dir, address="127.0.0.1:0", device="cpu", threads=1)

    async def main():
        port = asyncio.get_running_loop().create_future()
        running = asyncio.ensure_future(server.run(config, ready=port.set_result))
        await asyncio.wait([port, running], return_when=asyncio.FIRST_COMPLETED)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port.result()}") as channel:
                await wait_serving(channel)
                stub = verifier_pb2_grpc.VerifierStub(channel)
                info = await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest())
                files = (await stub.GetTokenizer(verifier_pb2.GetTokenizerRequest())).files
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            await running
        # What a gateway on another host needs, byte for byte, and never the weights.
        model_dir = pathlib.Path(tiny_model_dir)
        assert {"config.json", "generation_config.json"} <= set(files)
        assert all(files[name] == (model_dir / name).read_bytes() for name in files)
        assert not [name for name in files if name.endswith(".safetensors")]
        assert info.model_name == os.path.basename(tiny_model_dir)
        assert info.vocab_size == VOCAB
        assert info.max_context_len == MAX_CONTEXT
        assert list(info.eos_token_ids) == list(GENERATION_EOS)
        # --dtype auto: bf16 on a CPU that multiplies it natively (test_auto_dtype.py).
        served = "bfloat16" if cpu_has_native_bf16() else "float32"
        assert (info.device, info.dtype, info.tensor_parallel_size) == ("cpu", served, 1)
        # Measured at start-up at each batch size, for the gateway to cut drafts by (draft_cost.py).
        costs = dict(info.draft_token_cost_by_batch_size)
        assert set(costs) == {size for size, _ in BATCH_SIZES} and all(cost >= 0 for cost in costs.values())
        assert costs[1] == pytest.approx(info.draft_token_cost)

    asyncio.run(main())
