"""Continuous batching: concurrent sequences with different contexts, drafts
and prefill stages share forward passes and still decode exactly as alone."""

import pytest
import structlog
import structlog.testing

from verifier_service.scheduler import BatchLimits
from verifier_service.sequence import Draft, GenerationParams

from .conftest import make_engine
from .test_engine import GREEDY, check_cache, reference, wrong

PROMPTS = [[5, 17, 9, 40, 22, 8, 31], [3] * 40, [60, 2, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
DRAFTERS = [
    lambda future: future[:4],
    lambda future: [],
    lambda future: [wrong(t) for t in future[:3]],
    lambda future: [*future[:2], wrong(future[2]) if len(future) > 2 else 0],
]


def run_together(engine, prompts, refs, drafters, n):
    """Drives all sequences at once: each submits its next step as soon as the previous one is answered."""
    seqs = [engine.open(f"s{i}", p, GenerationParams(GREEDY, max_new_tokens=n, ignore_eos=True))
            for i, p in enumerate(prompts)]
    answers = {}

    def submit(i):
        seq = seqs[i]
        draft = Draft(tuple(drafters[i](refs[i][seq.num_generated:]))) if seq.num_steps else Draft()
        engine.submit(seq, draft, lambda result, i=i: answers.setdefault(i, result))

    for i in range(len(seqs)):
        submit(i)
    while any(not s.finished for s in seqs):
        assert engine.step()
        for i, result in list(answers.items()):
            del answers[i]
            assert not isinstance(result, Exception), result
            check_cache(seqs[i])
            if not seqs[i].finished:
                submit(i)
    return seqs


@pytest.mark.parametrize("max_tokens", [512, 8])
def test_batched_sequences_decode_as_alone(runner, hf_model, max_tokens):
    passes = []
    engine = make_engine(runner, limits=BatchLimits(max_tokens=max_tokens), on_step=passes.append)
    refs = [reference(hf_model, p, 12) for p in PROMPTS]
    seqs = run_together(engine, PROMPTS, refs, DRAFTERS, 12)
    for seq, ref, prompt in zip(seqs, refs, PROMPTS):
        assert seq.tokens[len(prompt):] == ref
    most = max(p.num_sequences for p in passes)
    assert most == len(PROMPTS) if max_tokens >= 64 else most >= 2
    assert max(p.num_tokens for p in passes) <= max_tokens
    assert engine.blocks.used_blocks == 0


def test_a_long_prefill_is_chunked_and_does_not_stall_decoding(runner, hf_model):
    passes = []
    engine = make_engine(runner, limits=BatchLimits(max_tokens=16), on_step=passes.append)
    short = engine.open("short", PROMPTS[0], GenerationParams(GREEDY, max_new_tokens=8, ignore_eos=True))
    engine.prefill(short)
    long_prompt = [(7 * i) % 60 + 4 for i in range(100)]
    long = engine.open("long", long_prompt, GenerationParams(GREEDY, max_new_tokens=4, ignore_eos=True))
    long_answers, short_answers = [], []
    engine.submit(long, Draft(), long_answers.append)
    engine.submit(short, Draft(), short_answers.append)
    engine.step()
    # The decode step ran in the first pass, beside the first chunk of the prompt.
    assert len(short_answers) == 1 and not long_answers
    assert passes[-1].num_sequences == 2 and passes[-1].num_prefill_tokens == 15
    while not long_answers:
        engine.step()
    assert long_answers[0].token_ids == reference(hf_model, long_prompt, 1)
    assert all(p.num_tokens <= 16 for p in passes)


def test_each_answer_reports_how_many_sequences_ran_when_its_pass_did(runner):
    """SessionResponse.num_running: every client's sequences, the load a gateway sizes drafts by."""
    engine = make_engine(runner)
    params = GenerationParams(GREEDY, max_new_tokens=4, ignore_eos=True)
    first, second = (engine.open(f"n{i}", prompt, params) for i, prompt in enumerate(PROMPTS[:2]))
    assert [result.num_running for result in engine.run_together([(first, Draft()), (second, Draft())])] == [2, 2]
    engine.close(first)
    assert engine.run(second).num_running == 1
    engine.close(second)


def test_a_devices_draft_limit_cuts_drafts_and_keeps_the_output(runner, hf_model):
    """On an NPU a step verifies at most 15 draft tokens of a sequence (vllm-ascend's 16 tokens a
    pass; 3 here): longer drafts are cut to fit, and greedy output is unchanged."""
    passes = []
    engine = make_engine(runner, limits=BatchLimits(max_draft_tokens=3), on_step=passes.append)
    refs = [reference(hf_model, p, 12) for p in PROMPTS]
    drafters = [lambda future: future[:8], lambda future: future[:6], lambda future: [wrong(t) for t in future[:5]],
                lambda future: future[:1]]
    seqs = run_together(engine, PROMPTS, refs, drafters, 12)
    for seq, ref, prompt in zip(seqs, refs, PROMPTS):
        assert seq.tokens[len(prompt):] == ref
    # No pass verified more than 3 draft tokens a sequence (uncut, the first passes would hold 8 + 6 + 5 + 1).
    assert all(p.num_draft_tokens <= 3 * p.num_sequences for p in passes)
    assert any(p.num_draft_tokens == 3 * p.num_sequences for p in passes)


@pytest.mark.parametrize("device, limit", [("npu", 15), ("npu:3", 15), ("cpu", 0), ("cuda:0", 0)])
def test_only_an_npu_limits_a_steps_draft_and_says_so_once_at_start(tiny_model_dir, device, limit):
    from verifier_service.config import VerifierConfig
    from verifier_service.workers import batch_limits

    with structlog.testing.capture_logs() as logs:
        limits = batch_limits(VerifierConfig(model=tiny_model_dir), device)
    assert limits.max_draft_tokens == limit
    warned = [entry for entry in logs if entry["event"] == "draft_tokens_cut"]
    assert len(warned) == (1 if limit else 0)
    if limit:
        assert warned[0]["setting"] == "num_speculative_tokens" and "vllm-ascend" in warned[0]["action"]
