"""The engine on a tiny random Llama: speculative greedy decoding equals
transformers' generate, KV rollback, stop conditions, sampling losslessness."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import DynamicCache, GenerationConfig

from verifier_service import engine as engine_module
from verifier_service.errors import InvalidRequest, SequenceFinished, StaleDraft
from verifier_service.model_runner import ModelRunner
from verifier_service.sampling import SamplingParams
from verifier_service.sequence import Draft, FinishReason, GenerationParams, Proposal

from .conftest import MAX_CONTEXT, VOCAB, make_engine, sequence_kv
from .test_verify import sample

PROMPT = [5, 17, 9, 40, 22, 8, 31]
GREEDY = SamplingParams()


def reference(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding, never stopping early."""
    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    ids = torch.tensor([prompt])
    # An explicit mask: otherwise generate() masks prompt tokens equal to pad_token_id.
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


DRAFTERS = {
    "empty": lambda future: [],
    "all_right": lambda future: future[:4],
    "all_wrong": lambda future: [wrong(t) for t in future[:4]],
    "partly_right": lambda future: [*future[:2], *(wrong(t) for t in future[2:4])],
}


def check_cache(seq) -> None:
    if seq.finished:
        assert seq.blocks is None
    else:
        assert seq.num_cached == len(seq.tokens) - 1


def decode(engine, params: GenerationParams, drafter, ref: list[int], prompt=PROMPT):
    """Drives a sequence to its end; drafts come from the reference continuation."""
    seq = engine.open("s", prompt, params)
    steps = [engine.prefill(seq)]
    check_cache(seq)
    while not seq.finished:
        future = ref[seq.num_generated:]
        steps.append(engine.verify(seq, Draft(tuple(drafter(future)))))
        check_cache(seq)
    return seq, steps


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_speculation_equals_generate(engine, hf_model, drafter):
    ref = reference(hf_model, PROMPT, 20)
    params = GenerationParams(GREEDY, max_new_tokens=20, ignore_eos=True)
    seq, steps = decode(engine, params, DRAFTERS[drafter], ref)
    assert seq.tokens[len(PROMPT):] == ref
    assert seq.finish_reason is FinishReason.LENGTH
    accepted = [step.num_accepted for step in steps[1:]]
    if drafter == "all_right":
        assert all(n == 4 for n in accepted[:-1])
    elif drafter == "partly_right":
        assert all(n == 2 for n in accepted[:-1])
    else:
        assert not any(accepted)
    assert steps[-1].committed_len == len(PROMPT) + 20
    assert engine.num_live == 1
    engine.close(seq)
    assert engine.num_live == 0


def assert_kv_matches_a_fresh_forward(runner, hf_model, seq) -> None:
    """The sequence's keys/values in its blocks equal those of one clean pass over the committed tokens."""
    cache = DynamicCache(config=hf_model.config)
    with torch.no_grad():
        hf_model(torch.tensor([seq.tokens[:-1]]), past_key_values=cache, use_cache=True)
    for layer, clean in enumerate(cache.layers):
        keys, values = sequence_kv(runner, seq, layer)
        assert torch.allclose(keys, clean.keys[0], atol=1e-5)
        assert torch.allclose(values, clean.values[0], atol=1e-5)


def test_rollback_then_continue_matches_a_fresh_forward(engine, runner, hf_model):
    seq = engine.open("s", PROMPT, GenerationParams(GREEDY, max_new_tokens=50, ignore_eos=True))
    engine.prefill(seq)
    for draft in ([1, 2, 3, 4, 5, 6], [7], [], [9, 9, 9]):
        engine.verify(seq, Draft(tuple(draft)))
        check_cache(seq)
    assert_kv_matches_a_fresh_forward(runner, hf_model, seq)


def test_stop_token_inside_accepted_drafts_truncates(engine, hf_model):
    ref = reference(hf_model, PROMPT, 20)
    stop = ref[5]
    first = ref.index(stop)
    params = GenerationParams(GREEDY, max_new_tokens=20, stop_token_ids=frozenset({stop}), ignore_eos=True)
    seq, steps = decode(engine, params, lambda future: future[:8], ref)
    assert seq.tokens[len(PROMPT):] == ref[: first + 1]
    assert steps[-1].token_ids[-1] == stop
    assert seq.finish_reason is FinishReason.STOP
    with pytest.raises(SequenceFinished):
        engine.verify(seq, Draft())


def test_eos_stops_unless_ignored(engine, hf_model, runner, monkeypatch):
    ref = reference(hf_model, PROMPT, 12)
    monkeypatch.setattr(runner, "eos_token_ids", (ref[3],))
    seq, _ = decode(engine, GenerationParams(GREEDY, max_new_tokens=12), lambda future: future[:2], ref)
    assert seq.tokens[len(PROMPT):] == ref[: ref.index(ref[3]) + 1]
    assert seq.finish_reason is FinishReason.STOP
    seq, _ = decode(engine, GenerationParams(GREEDY, max_new_tokens=12, ignore_eos=True), lambda f: f[:2], ref)
    assert seq.tokens[len(PROMPT):] == ref


def test_max_new_tokens_cuts_the_draft_to_what_can_be_committed(engine, hf_model):
    ref = reference(hf_model, PROMPT, 5)
    seq = engine.open("s", PROMPT, GenerationParams(GREEDY, max_new_tokens=5, ignore_eos=True))
    engine.prefill(seq)
    step = engine.verify(seq, Draft(tuple(ref[1:]) + (1, 2, 3)))
    assert step.token_ids == ref[1:]
    # 4 tokens left: 3 draft tokens and the target's own; a 4th draft token could add nothing.
    assert (step.num_draft_tokens, step.num_accepted) == (3, 3)
    assert step.finish_reason is FinishReason.LENGTH
    assert seq.blocks is None


def test_context_length_finishes_with_length(engine, hf_model):
    prompt = [(7 * i) % VOCAB for i in range(MAX_CONTEXT - 4)]
    ref = reference(hf_model, prompt, 4)
    seq = engine.open("s", prompt, GenerationParams(GREEDY, max_new_tokens=50, ignore_eos=True))
    engine.prefill(seq)
    step = engine.verify(seq, Draft(tuple(ref[1:]) + (1, 2, 3, 4)))
    assert step.token_ids == ref[1:]
    assert step.committed_len == MAX_CONTEXT
    assert step.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ([3, VOCAB], "outside the vocabulary"),
    ([-1], "outside the vocabulary"),
    ([1] * MAX_CONTEXT, "no room"),
])
def test_bad_prompts_are_refused(engine, prompt, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.open("s", prompt, GenerationParams())
    assert engine.num_live == 0


@pytest.mark.parametrize("draft, message", [
    (Draft((1, 2), parents=(-1, 1)), "must be -1 or the index of an earlier token"),
    (Draft((1, 2), parents=(-1,)), "parents"),
    (Draft((1, VOCAB)), "outside the vocabulary"),
    (Draft((1, 2), proposals=(Proposal((1,), (1.0,)),)), "proposal distributions"),
    (Draft((1,), proposals=(Proposal((1, 2), (1.0,)),)), "probs"),
    (Draft((1,), proposals=(Proposal((2,), (1.0,)),)), "no probability"),
    (Draft((1,), proposals=(Proposal((1,), (float("nan"),)),)), "non-finite"),
])
def test_bad_drafts_are_refused(engine, draft, message):
    seq = engine.open("s", PROMPT, GenerationParams(max_new_tokens=4))
    engine.prefill(seq)
    with pytest.raises(InvalidRequest, match=message):
        engine.verify(seq, draft)
    assert engine.verify(seq, Draft((1, 2), parents=(-1, 0))).committed_len > len(PROMPT) + 1


def test_stale_draft_is_refused(engine):
    seq = engine.open("s", PROMPT, GenerationParams(max_new_tokens=4))
    engine.prefill(seq)
    with pytest.raises(StaleDraft):
        engine.verify(seq, Draft((1,), committed_len=len(PROMPT)))
    engine.verify(seq, Draft((1,), committed_len=len(PROMPT) + 1))


def test_seeded_sampling_is_reproducible(engine):
    def run(seed):
        params = GenerationParams(SamplingParams(temperature=1.0, seed=seed), max_new_tokens=8, ignore_eos=True)
        seq = engine.open("s", PROMPT, params)
        engine.prefill(seq)
        while not seq.finished:
            engine.verify(seq, Draft((4, 5)))
        return seq.tokens

    assert run(11) == run(11)
    assert len({tuple(run(seed)) for seed in range(5)}) > 1


def test_a_seeded_sequence_samples_alike_alone_and_among_unseeded_ones(engine):
    """The unseeded sequences draw from the engine's one generator (a pass draws their uniforms at once); a
    seeded one from its own, so what shares its passes changes none of its tokens."""
    def run(num_unseeded: int) -> list[int]:
        seqs = [engine.open(f"s{i}", PROMPT, GenerationParams(SamplingParams(temperature=1.0, seed=None if i else 7),
                                                              max_new_tokens=8, ignore_eos=True))
                for i in range(1 + num_unseeded)]
        assert all(seq.generator is engine.generator for seq in seqs[1:]) and seqs[0].generator is not engine.generator
        engine.run_together([(seq, Draft()) for seq in seqs])
        while not seqs[0].finished:
            engine.run_together([(seq, Draft((4, 5)) if i % 2 else Draft((4, 5, 6), parents=(-1, -1, 0)))
                                 for i, seq in enumerate(seqs) if not seq.finished])
        for seq in seqs:
            engine.close(seq)
        return seqs[0].tokens

    assert run(0) == run(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("controls", [{}, {"top_p": 0.9, "presence_penalty": 0.5}], ids=["plain", "controls"])
def test_a_pass_reads_its_sampled_steps_from_the_device_at_once(tiny_model_dir, runner, dtype, controls):
    """On an accelerator every copy to the host waits for the device: a pass of sampled steps (decodes,
    chains, a tree; every other one with the controls, whose rows are widened apart from the rest's; every
    third asking for logprobs) makes as many as a pass of three, not one more per sequence."""
    engine = make_engine(runner if dtype == torch.float32 else ModelRunner(tiny_model_dir, "cpu", dtype))

    def copies_in_a_pass(count: int) -> int:
        seqs = [engine.open(f"c{i}", PROMPT, GenerationParams(
            SamplingParams(temperature=1.0, seed=i, **(controls if i % 2 else {})), max_new_tokens=8,
            ignore_eos=True, logprobs=2 if i % 3 == 0 else None)) for i in range(count)]
        engine.run_together([(seq, Draft()) for seq in seqs])
        drafts = [Draft(), Draft((4, 5)), Draft((4, 5, 6), parents=(-1, -1, 0))]
        answers = []
        for i, seq in enumerate(seqs):
            engine.submit(seq, drafts[i % 3], answers.append)
        copies, original = [], torch.Tensor.tolist

        def counted(tensor):
            copies.append(tensor.numel())
            return original(tensor)

        torch.Tensor.tolist = counted
        try:
            engine.step()
        finally:
            torch.Tensor.tolist = original
        assert len(answers) == count and not any(isinstance(answer, Exception) for answer in answers)
        assert sum(len(answer.logprobs) == len(answer.token_ids) > 0 for answer in answers) == -(-count // 3)
        for seq in seqs:
            engine.close(seq)
        return len(copies)

    assert copies_in_a_pass(12) == copies_in_a_pass(3)


SAMPLING_TRIALS = 1000
# A prompt whose first sampled token is nearly certain, so the second token's
# distribution is sharp enough for a chi-square test to see a wrong rule.
SAMPLING_PROMPT = [11, 60, 7, 43, 48, 33]


def exact_second_token(hf_model, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For plain sampling at temperature 1: the marginal of the 2nd token, and per
    candidate draft token x, E[p(x)(1 - p(x))] over the 1st token."""
    with torch.no_grad():
        first = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1], -1).double()
        both = torch.tensor([[*prompt, t] for t in range(VOCAB)])
        second = torch.softmax(hf_model(both).logits[:, -1], -1).double()
    return (first @ second).numpy(), (first @ (second * (1 - second))).numpy()


def speculative_second_tokens(engine, draft: Draft) -> list[int]:
    tokens = []
    for seed in range(SAMPLING_TRIALS):
        params = GenerationParams(SamplingParams(temperature=1.0, seed=seed), max_new_tokens=8, ignore_eos=True)
        seq = engine.open("s", SAMPLING_PROMPT, params)
        engine.prefill(seq)
        tokens.append(engine.verify(seq, draft).token_ids[0])
        engine.close(seq)
    return tokens


def p_value(tokens: list[int], probs: np.ndarray) -> float:
    expected = probs * len(tokens)
    observed = np.bincount(tokens, minlength=VOCAB)
    # Chi-square needs about 5 expected counts per cell: pool the rare tokens.
    rare = expected < 5
    observed = np.append(observed[~rare], observed[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    return chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def sampled_draft(hf_model) -> tuple[np.ndarray, Draft]:
    """The exact plain-sampling distribution, and a deterministic draft whose
    first token the target accepts about half the time."""
    plain, coin_flip = exact_second_token(hf_model, SAMPLING_PROMPT)
    assert coin_flip.max() > 0.15  # otherwise accepting and rejecting look alike
    return plain, Draft((int(coin_flip.argmax()), 7))


def test_speculative_sampling_matches_plain_sampling(engine, hf_model):
    plain, draft = sampled_draft(hf_model)
    tokens = speculative_second_tokens(engine, draft)
    assert 0.1 < tokens.count(draft.token_ids[0]) / SAMPLING_TRIALS < 0.9
    assert p_value(tokens, plain) > 0.001


def test_the_chi_square_catches_a_lossy_rejection_rule(engine, hf_model, monkeypatch):
    def resample_from_full_p(probs, steps):
        """Wrong: a rejected draft token can be drawn again (decisions as sampled_verdicts reads a chain's)."""
        decisions = []
        for step in steps:
            p, draft = probs[step.first_row], step.draft
            accepted = int(bool(draft) and torch.rand((), generator=step.generator) < p[draft[0]])
            decisions += [accepted, sample(p, step.generator), 1]
        return torch.tensor(decisions)

    monkeypatch.setattr(engine_module, "sampled_decisions", resample_from_full_p)
    plain, draft = sampled_draft(hf_model)
    assert p_value(speculative_second_tokens(engine, draft), plain) < 1e-6
