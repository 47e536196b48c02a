"""Logprobs of committed tokens: vLLM's raw logprobs (the log-softmax of the
model's own logits at each token's position, before any control), the same
whether a token came from a draft or not, cut with the tokens, over gRPC."""

import asyncio

import grpc
import pytest
import torch

from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.errors import InvalidRequest
from verifier_service.sequence import Draft, GenerationParams
from verifier_service.service import params_from_proto
from verifier_service.verify import Verdict, committed_logprobs

from .test_engine import GREEDY, PROMPT, reference
from .test_logits_processing import CONTROLS, DRAFTERS, STOP, reference_greedy, speculate
from .test_service import prefill, running_verifier, session_error, verify, wait_serving, wrong

NUM_TOP = 5


def raw_logprobs(hf_model, output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: the log-softmax of the model's row that predicted each output token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1: -1]
    return torch.log_softmax(logits, dim=-1)


def all_logprobs(steps) -> list:
    assert all(len(step.logprobs) == len(step.token_ids) for step in steps)
    return [logprob for step in steps for logprob in step.logprobs]


def test_each_committed_token_gets_the_row_that_judged_it():
    logits = torch.zeros(10, 8)
    logits[torch.arange(10), (torch.arange(10) + 3) % 8] = 10.0  # row r favours token r + 3
    # Step one, rows 0-6: accepted nodes 1 and 4, so its tokens come from rows 0, 2 and 5. Step two, rows 7-9,
    # one alternative: its first node rejected, a correction from its row 0 (row 7 of the pass).
    got, second = committed_logprobs(logits, [(0, Verdict([3, 5, 0], 2, path=[1, 4]), 2), (7, Verdict([2], 0), 1)])
    favoured = torch.log_softmax(logits[0], -1)[3].item()
    assert [entry.top_token_ids[0] for entry in got] == [3, 5, 0]
    assert [entry.logprob for entry in got] == pytest.approx([favoured] * 3, abs=1e-6)
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[1] < entry.top_logprobs[0] for entry in got)
    assert [(entry.top_token_ids, entry.logprob) for entry in second] == [((2,), pytest.approx(favoured))]


def test_logprobs_are_the_raw_log_softmax_even_with_controls_on(engine, hf_model):
    params = GenerationParams(CONTROLS, max_new_tokens=24, logprobs=NUM_TOP)
    seq, steps = speculate(engine, params, DRAFTERS["none"], [])
    output = seq.tokens[len(PROMPT):]
    expected = raw_logprobs(hf_model, output)
    got = all_logprobs(steps)
    assert len(steps[0].logprobs) == 1  # the prefill's token too
    for row, token, entry in zip(expected, output, got):
        top = torch.topk(row, NUM_TOP)
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.top_token_ids == tuple(top.indices.tolist())
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    # The controls picked tokens the raw distribution does not favour, and those keep their raw logprob.
    assert any(entry.top_token_ids[0] != token for token, entry in zip(output, got))


@pytest.mark.parametrize("drafter", ["right", "wrong", "partly_right", "tree"])
def test_logprobs_do_not_depend_on_the_drafts(engine, hf_model, drafter):
    params = GenerationParams(CONTROLS, max_new_tokens=24, logprobs=NUM_TOP)
    ref = reference_greedy(hf_model, params, STOP)
    _, plain = speculate(engine, params, DRAFTERS["none"], ref)
    seq, drafted = speculate(engine, params, DRAFTERS[drafter], ref)
    assert seq.tokens[len(PROMPT):] == ref
    for token, want, got in zip(ref, all_logprobs(plain), all_logprobs(drafted), strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.top_token_ids == want.top_token_ids
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-4)
        assert list(got.top_logprobs) == sorted(got.top_logprobs, reverse=True)
        if got.top_token_ids[0] == token:
            assert got.logprob == got.top_logprobs[0]


def test_logprobs_are_cut_with_the_tokens_at_a_stop(engine, hf_model):
    ref = reference(hf_model, PROMPT, 20)
    stop = ref[5]
    params = GenerationParams(GREEDY, max_new_tokens=20, stop_token_ids=frozenset({stop}), ignore_eos=True,
                              logprobs=1)
    seq, steps = speculate(engine, params, lambda future: Draft(tuple(future[:8])), ref)
    output = seq.tokens[len(PROMPT):]
    assert output == ref[: ref.index(stop) + 1]  # the step accepted drafts past the stop
    expected = raw_logprobs(hf_model, output)
    got = all_logprobs(steps)
    # Another computation of the same rows (HF's own forward): equal up to fp32 rounding, as above.
    assert [entry.logprob for entry in got] == pytest.approx(expected.gather(1, torch.tensor(output)[:, None])[:, 0],
                                                             abs=1e-4)


def test_logprobs_only_when_asked_and_zero_means_no_alternatives(engine):
    _, steps = speculate(engine, GenerationParams(max_new_tokens=6, ignore_eos=True), DRAFTERS["none"], [])
    assert all(step.logprobs == [] for step in steps)
    _, steps = speculate(engine, GenerationParams(max_new_tokens=6, ignore_eos=True, logprobs=0),
                         DRAFTERS["none"], [])
    got = all_logprobs(steps)
    assert len(got) == 6 and all(entry.logprob < 0 and entry.top_token_ids == () for entry in got)


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_logprobs_outside_0_to_20_are_refused(logprobs):
    with pytest.raises(InvalidRequest, match=r"logprobs must be in \[0, 20\]"):
        GenerationParams(logprobs=logprobs)


def test_logprobs_over_grpc(tiny_model_dir, engine, hf_model):
    sampling = verifier_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)
    ref = reference(hf_model, PROMPT, 3)
    draft = (ref[1], wrong(ref[2]))  # one accepted token, then the correction
    seq = engine.open("ref", PROMPT, params_from_proto(verifier_pb2.Prefill(sampling=sampling)))
    expected = [engine.prefill(seq).logprobs, engine.verify(seq, Draft(draft)).logprobs]

    def same(answer, want) -> None:
        assert len(answer.logprobs) == len(answer.token_ids) == len(want)
        for got, entry in zip(answer.logprobs, want):
            assert got.logprob == pytest.approx(entry.logprob, abs=1e-4)
            assert tuple(got.top_token_ids) == entry.top_token_ids
            assert list(got.top_logprobs) == pytest.approx(entry.top_logprobs, abs=1e-4)

    async def main():
        async with running_verifier(tiny_model_dir) as (channel, async_engine):
            await wait_serving(channel)
            call = verifier_pb2_grpc.VerifierStub(channel).Session()
            await call.write(prefill(sampling=sampling))
            same(await call.read(), expected[0])
            await call.write(verify(draft))
            same(await call.read(), expected[1])
            call.cancel()
            error = await session_error(channel, prefill(sampling=verifier_pb2.SamplingParams(max_new_tokens=4,
                                                                                             logprobs=21)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "logprobs must be in [0, 20]" in error.details()

    asyncio.run(main())
