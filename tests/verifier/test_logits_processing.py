"""Logit controls with vLLM's meanings, each verified row processed with the
draft path that leads to it: hand-computed expectations, greedy speculation
equal to one-token-at-a-time decoding, sampled speculation distributed as
the processed target, and validation down to gRPC status codes."""

import asyncio
import gc
import math
import random

import grpc
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from protos.conventions import chain_parents
from protos.verifier.v1 import verifier_pb2
from speclane_cli.bench.verifier import OperationCount
from verifier_service import sampling
from verifier_service.errors import InvalidRequest
from verifier_service.logits_processing import (
    ControlledStep,
    LogitsProcessor,
    apply_logit_controls,
    make_logits_processor,
)
from verifier_service.penalties import SeenTokenCounts, TokenCounts, penalty_counts
from verifier_service.sampling import (
    CPU_GROUP_BYTES,
    NUCLEUS_WIDTH,
    SamplingParams,
    batch_target_probs,
    step_groups,
    target_probs,
)
from verifier_service.sequence import Draft, FinishReason, GenerationParams
from verifier_service.service import params_from_proto
from verifier_service.verify import verify_sampled

from .conftest import GENERATION_EOS, VOCAB
from .test_engine import PROMPT, wrong
from .test_service import prefill, running_verifier, session_error, wait_serving
from .test_tree import decoy_tree

CPU = torch.device("cpu")
INF = math.inf


def new_table(form: str, vocab: int, capacity: int = 16) -> TokenCounts | SeenTokenCounts:
    """The penalties' dense form (an accelerator's, run here on the CPU) or the seen-token form (a CPU's)."""
    return TokenCounts(vocab, CPU, capacity) if form == "dense" else SeenTokenCounts()


# The tests of the penalties run on both forms.
form = pytest.mark.parametrize("form", ["dense", "seen"])


def processor_for(params: SamplingParams, prompt, vocab: int, stop=frozenset(), form="dense") -> LogitsProcessor:
    return LogitsProcessor(params, len(prompt), frozenset(stop), new_table(form, vocab))


def process(processor: LogitsProcessor, rows, tokens, draft=(), parents=None) -> torch.Tensor:
    """One step's rows through its processor (a copy: the raw rows stay raw, as logprobs use them)."""
    step = ControlledStep(0, processor, list(tokens), list(draft), parents or chain_parents(len(draft)))
    return apply_logit_controls(rows.clone(), [step])


def processed(params: SamplingParams, prompt, output, rows, draft=(), parents=None, stop=frozenset(), form="dense"):
    return process(processor_for(params, prompt, rows.shape[-1], stop, form), rows, [*prompt, *output], draft,
                   parents)


def test_logit_bias_is_added_to_every_row():
    rows = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    out = processed(SamplingParams(logit_bias={0: 2.5, 3: -100.0}), [1], [], rows, draft=[2])
    assert torch.equal(out, torch.tensor([[3.5, 2.0, 3.0, -96.0], [2.5, 0.0, 0.0, -100.0]]))


def test_min_tokens_masks_stop_tokens_in_rows_short_of_it():
    # One token generated, min_tokens 3; tree rows at depths 0, 1, 1, 2 have generated 1, 2, 2, 3 tokens.
    out = processed(SamplingParams(min_tokens=3), [0], [1], torch.zeros(4, 6),
                    draft=[2, 3, 2], parents=(-1, -1, 1), stop={4, 5})
    expected = torch.zeros(4, 6)
    expected[:3, 4:] = -INF
    assert torch.equal(out, expected)
    assert torch.equal(processed(SamplingParams(min_tokens=3), [0], [1, 1, 1], torch.zeros(1, 6), stop={4}),
                       torch.zeros(1, 6))


@form
def test_repetition_penalty_shrinks_prompt_and_output_tokens_towards_unlikely(form):
    rows = torch.tensor([[2.0, 2.0, -2.0, 2.0, -2.0]])
    out = processed(SamplingParams(repetition_penalty=2.0), [0], [1, 4], rows, form=form)
    assert torch.equal(out, torch.tensor([[1.0, 1.0, -2.0, 2.0, -4.0]]))


@form
@pytest.mark.parametrize("penalty", [0.5, 0.8, 1.05, 2.0])
def test_repetition_penalty_divides_positive_and_multiplies_other_logits_bit_for_bit(penalty, form):
    """The branch-free form (the smaller of x / r and x * r for r >= 1, the larger below 1) gives the bits of
    vLLM's x / r where x > 0, else x * r, on random logits and on 0, -0, infinities and the largest floats."""
    generator = torch.Generator().manual_seed(2)
    special = torch.tensor([0.0, -0.0, INF, -INF, 3.4e38, -3.4e38, 1e-38, -1e-38])
    rows = torch.cat([special, torch.randn(200, generator=generator) * 10])[None]
    tokens = list(range(rows.shape[-1]))
    out = processed(SamplingParams(repetition_penalty=penalty), tokens, [], rows, form=form)
    expected = torch.where(rows > 0, rows / penalty, rows * penalty)
    assert torch.equal(out, expected) and torch.equal(out.signbit(), expected.signbit())


@form
def test_frequency_and_presence_penalties_count_output_tokens_only(form):
    out = processed(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0, 3], [1, 1, 2], torch.zeros(1, 4),
                    form=form)
    assert torch.equal(out, torch.tensor([[0.0, -1.25, -0.75, 0.0]]))


@form
def test_each_row_is_penalised_with_the_draft_path_that_leads_to_it(form):
    # root -> node 0 (token 2); root -> node 1 (token 1) -> node 2 (token 3) -> node 3 (token 2)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    out = processed(params, [0], [1], torch.ones(5, 5), draft=[2, 1, 3, 2], parents=(-1, -1, 1, 2), form=form)
    assert torch.equal(out, torch.tensor([
        [0.5, -1.0, 1.0, 1.0, 1.0],  # output 1
        [0.5, -1.0, -1.0, 1.0, 1.0],  # output 1, 2
        [0.5, -2.0, 1.0, 1.0, 1.0],  # output 1, 1
        [0.5, -2.0, 1.0, -1.0, 1.0],  # output 1, 1, 3
        [0.5, -2.0, -1.0, -1.0, 1.0],  # output 1, 1, 3, 2
    ]))


@form
def test_output_counts_follow_each_steps_committed_tokens(form):
    processor = processor_for(SamplingParams(frequency_penalty=1.0), [0], 4, form=form)
    assert torch.equal(process(processor, torch.zeros(1, 4), [0, 1]), torch.tensor([[0.0, -1.0, 0.0, 0.0]]))
    assert torch.equal(process(processor, torch.zeros(1, 4), [0, 1, 2, 2]), torch.tensor([[0.0, -1.0, -2.0, 0.0]]))


# Steps with every kind of control: (controls, prompt, output, draft, parents); None: a step without controls.
MIXED = [
    ({"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.25}, [1, 2], [3, 3, 4], [5, 3, 6],
     None),
    ({"logit_bias": {7: 3.0, 2: -1.5}, "min_tokens": 4}, [8], [9], [7, 10, 7], (-1, -1, 1)),
    None,
    ({"repetition_penalty": 0.8}, [11, 12, 11], [], [], None),
    ({"frequency_penalty": -0.75, "logit_bias": {13: 2.0}}, [14], [15, 13, 13], [13, 16, 13, 17], (-1, 0, 0, 2)),
    ({"min_tokens": 2}, [18], [], [19], None),
    None,
    ({"presence_penalty": 1.0, "min_tokens": 9}, [20], [21, 22], [21, 21], None),
]
MIXED_VOCAB, MIXED_STOP = 32, frozenset({0, 19})


def mixed_pass(processors, extra: list[int], generator, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MIXED's steps in one pass, each sequence having committed `extra` more tokens: their rows processed
    together, and each step's processed alone by a fresh processor (the steps without controls: raw)."""
    steps, raw, alone, first = [], [], [], 0
    for spec, processor in zip(MIXED, processors):
        draft, parents = (spec[3], spec[4] or chain_parents(len(spec[3]))) if spec else ([4, 5], chain_parents(2))
        rows = torch.randn(len(draft) + 1, MIXED_VOCAB, generator=generator) * 3
        raw.append(rows)
        if spec is None:
            alone.append(rows)
            first += len(rows)
            continue
        tokens = [*spec[1], *spec[2], *extra]
        own = processor_for(processor.params, spec[1], MIXED_VOCAB, MIXED_STOP, form)
        alone.append(process(own, rows, tokens, draft, parents))
        steps.append(ControlledStep(first, processor, tokens, draft, parents))
        first += len(rows)
    return apply_logit_controls(torch.cat(raw), steps), torch.cat(alone)


@form
def test_a_pass_processes_its_steps_together_as_each_alone(form):
    """Every kind of control, chains and trees, steps without controls between them (left raw), a table that
    must grow, and counts carried from one pass to the next: each row equals its step processed alone, bit for
    bit."""
    table = new_table(form, MIXED_VOCAB, capacity=1)
    processors = [spec and make_logits_processor(SamplingParams(**spec[0]), len(spec[1]), MIXED_STOP, table)
                  for spec in MIXED]
    generator = torch.Generator().manual_seed(3)
    for extra in ([], [23, 5, 23]):  # the second pass: three more tokens committed by each sequence
        together, alone = mixed_pass(processors, extra, generator, form)
        assert torch.equal(together, alone)
    if form == "dense":
        assert len(table.counts) == 4  # doubled from 1 for MIXED's four penalised sequences


def test_a_finished_sequences_row_is_taken_again_cleared():
    table = TokenCounts(4, CPU, capacity=1)
    first = make_logits_processor(SamplingParams(frequency_penalty=1.0), 1, frozenset(), table)
    assert torch.equal(apply_logit_controls(torch.zeros(1, 4), [ControlledStep(0, first, [3, 1, 1], [], ())]),
                       torch.tensor([[0.0, -2.0, 0.0, 0.0]]))
    row = first.row
    del first
    gc.collect()
    second = make_logits_processor(SamplingParams(repetition_penalty=2.0), 1, frozenset(), table)
    out = apply_logit_controls(torch.ones(1, 4), [ControlledStep(0, second, [2, 0], [], ())])
    assert second.row == row and len(table.counts) == 1
    assert torch.equal(out, torch.tensor([[0.5, 1.0, 0.5, 1.0]]))  # its prompt and output, none of the first's


@form
def test_a_pass_of_more_steps_runs_no_more_operations(form):
    """On an accelerator each operation is a kernel launch and each copy to it may wait for the device: twelve
    steps of every control cost what four do."""

    def operations(count: int) -> int:
        table = new_table(form, MIXED_VOCAB, capacity=2 * count)
        specs = [spec for spec in MIXED if spec is not None][:4] * (count // 4)
        processors = [make_logits_processor(SamplingParams(**spec[0]), len(spec[1]), MIXED_STOP, table)
                      for spec in specs]
        counted = OperationCount()
        for extra in ([], [23]):  # a first pass, and one with a committed token more
            steps, first = [], 0
            for spec, processor in zip(specs, processors):
                parents = spec[4] or chain_parents(len(spec[3]))
                steps.append(ControlledStep(first, processor, [*spec[1], *spec[2], *extra], spec[3], parents))
                first += len(spec[3]) + 1
            with counted:
                apply_logit_controls(torch.zeros(first, MIXED_VOCAB), steps)
        return counted.count

    assert operations(12) == operations(4)


def test_the_seen_token_form_gives_the_dense_forms_values():
    """Nine sequences over six passes, each pass's rows processed by both forms: prompts with repeats, outputs
    that grow past a sequence's first arrays, random trees and chains drafting tokens seen and unseen, every
    penalty above and below its neutral value, logits of 0 and of both infinities. Equal, bit for bit."""
    rng, generator, vocab = random.Random(5), torch.Generator().manual_seed(5), 64
    dense, seen = new_table("dense", vocab, capacity=1), new_table("seen", vocab)
    sequences = []
    for _ in range(9):
        params = SamplingParams(repetition_penalty=rng.choice([1.0, 0.7, 1.3]),
                                frequency_penalty=rng.choice([0.0, 0.4, -0.6]),
                                presence_penalty=rng.choice([0.0, 0.9, -0.2]) or 0.5)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        sequences.append((prompt, [], *(make_logits_processor(params, len(prompt), frozenset(), table)
                                         for table in (dense, seen))))
    for _ in range(6):
        steps, first = {"dense": [], "seen": []}, 0
        for prompt, output, by_dense, by_seen in sequences:
            output += [rng.randrange(vocab) for _ in range(rng.randrange(12))]
            draft = [rng.randrange(vocab) for _ in range(rng.randrange(6))]
            parents = tuple(rng.randrange(-1, node) for node in range(len(draft)))
            for name, processor in (("dense", by_dense), ("seen", by_seen)):
                steps[name].append(ControlledStep(first, processor, [*prompt, *output], draft, parents))
            first += len(draft) + 1
        rows = torch.randn(first, vocab, generator=generator) * 4
        rows[:, :3] = torch.tensor([INF, -INF, 0.0])
        assert torch.equal(apply_logit_controls(rows.clone(), steps["dense"]),
                           apply_logit_controls(rows.clone(), steps["seen"]))
    # Some sequence's arrays doubled.
    assert any(len(by_seen.seen.tokens) > max(16, 2 * len(set(prompt))) for prompt, _, _, by_seen in sequences)


def test_a_cpu_penalises_seen_tokens_alone_and_an_accelerator_whole_rows():
    assert isinstance(penalty_counts(VOCAB, CPU), SeenTokenCounts)
    assert isinstance(penalty_counts(VOCAB, torch.device("meta")), TokenCounts)


def test_min_p_cuts_after_temperature():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # At temperature 2, p is proportional to sqrt(probs): only the last token is under 0.4 x the top one.
    out = target_probs(probs.log()[None], SamplingParams(temperature=2.0, min_p=0.4))[0]
    expected = probs.sqrt() * torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert torch.allclose(out, expected / expected.sum())


def written_out_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's p written out with sorted Python lists: temperature, min_p, top-k, top-p (vLLM's order)."""
    logits = (row / params.temperature).tolist()
    if params.min_p:
        probs = torch.softmax(torch.tensor(logits), -1).tolist()
        logits = [-INF if p < params.min_p * max(probs) else x for x, p in zip(logits, probs)]
    if params.top_k:
        kth = sorted(logits, reverse=True)[min(params.top_k, len(logits)) - 1]
        logits = [x if x >= kth else -INF for x in logits]
    probs = torch.softmax(torch.tensor(logits), -1).tolist()
    if params.top_p is not None and params.top_p < 1:
        kept, mass = set(), 0.0
        for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
            if mass >= params.top_p:
                break
            kept.add(token)
            mass += probs[token]
        probs = [p if t in kept else 0.0 for t, p in enumerate(probs)]
    total = sum(probs)
    return torch.tensor([p / total for p in probs])


def test_one_batch_gives_every_steps_rows_their_own_controls():
    """The rows of five steps with different settings, computed together: each row as the written-out
    reference computes it with its own step's settings."""
    settings = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                SamplingParams(temperature=1.0, top_p=0.6),
                SamplingParams(temperature=0.9, min_p=0.05, top_k=40, top_p=0.9),
                SamplingParams(temperature=2.0, top_k=VOCAB + 10)]
    counts = [1, 3, 2, 4, 1]
    logits = torch.randn(sum(counts), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    together = batch_target_probs(logits, settings, counts)
    expected = torch.stack([written_out_probs(row, params) for rows, params in zip(logits.split(counts), settings)
                            for row in rows])
    assert torch.allclose(together, expected, atol=1e-6)
    assert (together[1:4] > 0).sum(-1).tolist() == [5, 5, 5]  # top-k reached its rows only


@pytest.mark.parametrize("by", ["kernel", "sort"])
@pytest.mark.parametrize("spread, top_k, narrow", [(8.0, None, True), (0.1, None, False), (0.1, 20, True),
                                                   (8.0, 5, True)], ids=["peaked", "flat", "flat top-k", "top-k 5"])
def test_top_p_finds_the_nucleus_among_the_likeliest_tokens_or_sorts_the_whole_row(spread, top_k, narrow, by,
                                                                                   monkeypatch):
    """A vocabulary wider than the partial sort: a peaked row's nucleus lies among its likeliest tokens, a flat
    row's does not and is found by sorting the whole row (an accelerator's way; a CPU's kernel finds either
    without sorting), and under top-k among top-k's tokens (the row of another step with top-p alone beside it,
    whose nucleus top-k's tokens do not hold); each as the written-out reference finds it, and the row without
    top-p keeps all its tokens."""
    if by == "sort":
        monkeypatch.setattr(sampling, "_kernel_takes", lambda probs: False)
    vocab = 3 * NUCLEUS_WIDTH
    rows = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * spread
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=0.9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.5)]
    together = batch_target_probs(rows, params, [1, 1, 1])
    expected = torch.stack([written_out_probs(row, setting) for row, setting in zip(rows, params)])
    assert torch.allclose(together, expected, atol=1e-6)
    assert ((together[0] > 0).sum() < NUCLEUS_WIDTH) == narrow
    assert (together[1] > 0).all()


def written_out_nucleus(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's nucleus with a sorted Python list (equal probabilities by index), renormalised."""
    values = row.tolist()
    kept, mass = set(), 0.0
    for token in sorted(range(len(values)), key=lambda t: -values[t]):
        if mass >= top_p:
            break
        kept.add(token)
        mass += values[token]
    nucleus = torch.tensor([v if t in kept else 0.0 for t, v in enumerate(values)], dtype=torch.float64)
    return (nucleus / nucleus.sum()).float()


def test_the_cpu_kernel_finds_the_nucleus_without_sorting_rows():
    """csrc/nucleus.cc against the written-out rule: a cut inside a run of equal probabilities (the first by
    index kept, as many as the mass allows), rows with zeros and -0.0 (counted as 0, never above a positive
    probability), a vocabulary of no round size, a row whose mass stays under top-p (all kept), a row without
    top-p copied bit for bit and a NaN row that stays NaN beside the others."""
    generator = torch.Generator().manual_seed(3)
    vocab = 3_001
    flat = torch.full((vocab,), 1.0)
    flat[:7] = torch.tensor([300.0, 200.0, 100.0, 50.0, 50.0, 25.0, 10.0])
    peaked = torch.softmax(torch.randn(vocab, generator=generator) * 6, -1)
    sparse = torch.softmax(torch.randn(vocab, generator=generator), -1)
    sparse[::3] = 0.0
    sparse[1::7] = -0.0
    rows = torch.stack([flat / flat.sum(), peaked, sparse / sparse.sum(), peaked, peaked / 2,
                        torch.full((vocab,), math.nan)])
    top_p = torch.tensor([0.6, 0.9, 0.3, 2.0, 0.9, 0.5])[:, None]
    out = sampling._cpu_nucleus(rows, top_p)
    for row, cut, got in zip(rows[:3], top_p[:3, 0].tolist(), out):
        assert torch.allclose(got, written_out_nucleus(row, cut), atol=1e-7, rtol=1e-5)
    kept_ties = int((out[0, 7:] > 0).sum())  # the cut lands among the 2,994 equal tokens
    assert 0 < kept_ties < vocab - 7 and (out[0, 7: 7 + kept_ties] > 0).all()
    assert torch.equal(out[3], rows[3])
    assert torch.allclose(out[4], peaked, atol=1e-9, rtol=1e-6)  # a mass under top-p: every token kept
    assert out[5].isnan().all()
    # A mass before a token equal to top-p drops it; of equal tokens the first by index comes first.
    exact = sampling._cpu_nucleus(torch.tensor([[0.25, 0.5, 0.25]] * 2), torch.tensor([[0.5], [0.75]]))
    assert torch.equal(exact, torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 2 / 3, 0.0]]))


def test_the_cpu_kernel_keeps_the_written_out_nucleus_of_rows_of_every_spread():
    """Rows from nearly flat to peaked, top-p from 0.05 to 0.999 (the cut in a crowded bucket, a sparse one, or
    the first token): the kernel keeps exactly the tokens the written-out rule keeps."""
    generator = torch.Generator().manual_seed(5)
    spreads = torch.logspace(-1.5, 1, 40).tolist()
    rows = torch.stack([torch.softmax(torch.randn(4_099, generator=generator) * spread, -1) for spread in spreads])
    top_p = torch.rand(len(spreads), 1, generator=generator) * 0.949 + 0.05
    top_p[::8] = 0.999
    out = sampling._cpu_nucleus(rows, top_p)
    for row, cut, got in zip(rows, top_p[:, 0].tolist(), out):
        expected = written_out_nucleus(row, cut)
        assert torch.equal(got > 0, expected > 0)
        assert torch.allclose(got, expected, atol=1e-7, rtol=1e-5)


def test_a_cpu_judges_rows_in_groups_within_its_budget_and_an_accelerator_all_at_once():
    counts = [4] * 64
    groups = step_groups(counts, 49_152, CPU)
    assert [i for group in groups for i in group] == list(range(64)) and len(groups) > 1
    assert all(sum(counts[i] for i in group) * 49_152 * 4 <= CPU_GROUP_BYTES for group in groups)
    assert step_groups([300], 151_936, CPU) == [range(1)]  # a step over the budget is a group of its own
    assert step_groups(counts, 49_152, torch.device("meta")) == [range(64)]
    assert step_groups([], 49_152, CPU) == []


def test_a_request_without_controls_gets_no_processor():
    def processor(**controls):
        return make_logits_processor(SamplingParams(**controls), 1, frozenset({2}), TokenCounts(VOCAB, CPU))

    assert processor(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1) is None
    for control in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1},
                    {"logit_bias": {3: 1.0}}, {"min_tokens": 1}):
        assert processor(**control) is not None, control


def controlled(raw: torch.Tensor, prompt, output, params: SamplingParams, stop) -> torch.Tensor:
    """vLLM's controls written out token by token: the reference for the per-row version."""
    logits = raw.tolist()
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    if len(output) < params.min_tokens:
        for token in stop:
            logits[token] = -INF
    for token, logit in enumerate(logits):
        count = output.count(token)
        if count or token in prompt:
            logit = logit / params.repetition_penalty if logit > 0 else logit * params.repetition_penalty
        logits[token] = logit - params.frequency_penalty * count - params.presence_penalty * (count > 0)
    return torch.tensor(logits)


def last_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0, -1]


def reference_greedy(hf_model, params: GenerationParams, stop, prompt=PROMPT) -> list[int]:
    """One token at a time: the argmax of the controlled last row over everything so far."""
    output: list[int] = []
    while len(output) < params.max_new_tokens and not (output and output[-1] in stop):
        raw = last_logits(hf_model, prompt + output)
        output.append(int(controlled(raw, prompt, output, params.sampling, stop).argmax()))
    return output


DRAFTERS = {
    "none": lambda future: Draft(),
    "right": lambda future: Draft(tuple(future[:4])),
    "wrong": lambda future: Draft(tuple(wrong(t) for t in future[:4])),
    "partly_right": lambda future: Draft((*future[:2], *(wrong(t) for t in future[2:4]))),
    "tree": lambda future: decoy_tree(future) if len(future) > 3 else Draft(tuple(future)),
}
# Strong enough to change this prompt's greedy output; EOS stays on, held back by min_tokens.
CONTROLS = SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                          logit_bias={45: -2.0, 21: 1.5}, min_tokens=8)
STOP = frozenset(GENERATION_EOS)


def speculate(engine, params: GenerationParams, drafter, ref: list[int]):
    """Drives a sequence to its end with drafts made from the reference continuation."""
    seq = engine.open("s", PROMPT, params)
    steps = [engine.prefill(seq)]
    while not seq.finished:
        steps.append(engine.verify(seq, drafter(ref[seq.num_generated:])))
    engine.close(seq)
    return seq, steps


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_speculation_with_controls_equals_one_token_at_a_time(engine, hf_model, drafter):
    params = GenerationParams(CONTROLS, max_new_tokens=24)
    ref = reference_greedy(hf_model, params, STOP)
    assert ref != reference_greedy(hf_model, GenerationParams(max_new_tokens=24), STOP)  # the controls matter
    seq, steps = speculate(engine, params, DRAFTERS[drafter], ref)
    assert seq.tokens[len(PROMPT):] == ref
    if drafter in ("right", "tree"):
        assert all(step.num_accepted >= 3 for step in steps[1:-1])


def test_sequences_with_different_controls_speculate_together_as_each_alone(engine, hf_model):
    """Greedy sequences with different controls (and one with none) verify their drafts in shared passes, their
    rows processed together: each output is its own one-token-at-a-time reference."""
    controls = [CONTROLS, SamplingParams(repetition_penalty=1.6, min_tokens=10),
                SamplingParams(logit_bias={45: 4.0, 3: 2.5}), SamplingParams(),
                SamplingParams(frequency_penalty=0.9, presence_penalty=-0.5, min_tokens=6)]
    params = [GenerationParams(sampling, max_new_tokens=16) for sampling in controls]
    refs = [reference_greedy(hf_model, p, STOP) for p in params]
    drafters = [DRAFTERS["right"], DRAFTERS["tree"], DRAFTERS["partly_right"], DRAFTERS["right"], DRAFTERS["wrong"]]
    seqs = [engine.open(f"s{i}", PROMPT, p) for i, p in enumerate(params)]
    engine.run_together([(seq, Draft()) for seq in seqs])
    while running := [(seq, drafter(ref[seq.num_generated:])) for seq, drafter, ref in zip(seqs, drafters, refs)
                      if not seq.finished]:
        engine.run_together(running)
    assert [seq.tokens[len(PROMPT):] for seq in seqs] == refs
    assert len({tuple(ref) for ref in refs}) == len(refs)  # the controls matter


@pytest.mark.parametrize("temperature", [None, 1.0])
def test_min_tokens_holds_a_favoured_stop_token_back_even_when_drafted(engine, temperature):
    eos = GENERATION_EOS[0]
    sampling = SamplingParams(temperature=temperature, seed=0, logit_bias={eos: 100.0}, min_tokens=5)
    seq = engine.open("s", PROMPT, GenerationParams(sampling, max_new_tokens=20))
    engine.prefill(seq)
    while not seq.finished:
        engine.verify(seq, Draft((eos, eos, eos)))
    output = seq.tokens[len(PROMPT):]
    assert eos not in output[:5] and output[5] == eos
    assert seq.finish_reason is FinishReason.STOP


TRIALS = 10_000
# A context (prompt, committed output) and a draft token the processed target
# takes ~70% of the time, found so that counting the draft token in the next
# row's penalties changes that row's distribution a lot.
CHI_PROMPT, CHI_OUTPUT, CHI_DRAFT = [9, 27, 51, 60, 11, 34], [6, 49], 20
SAMPLED = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=1.5, repetition_penalty=1.5,
                         min_p=0.05)


def reference_probs(raw: torch.Tensor, output: list[int]) -> torch.Tensor:
    p = torch.softmax(controlled(raw, CHI_PROMPT, output, SAMPLED, ()) / SAMPLED.temperature, -1)
    p[p < SAMPLED.min_p * p.max()] = 0.0
    return p / p.sum()


def p_value(tokens: list[int], probs: torch.Tensor) -> float:
    """Chi-square over the tokens `probs` allows (min_p leaves many at 0), the
    rare ones pooled: the test wants about 5 expected counts per cell."""
    observed = np.bincount(tokens, minlength=len(probs))[probs > 0]
    expected = probs[probs > 0].double().numpy() * len(tokens)
    rare = expected < 5
    if rare.any():
        observed = np.append(observed[~rare], observed[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
    return chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def test_sampled_speculation_draws_each_position_from_its_processed_distribution(hf_model):
    tokens, draft = CHI_PROMPT + CHI_OUTPUT, [CHI_DRAFT, 7]
    with torch.no_grad():
        rows = hf_model(torch.tensor([tokens + draft])).logits[0, len(tokens) - 1:]
    probs = target_probs(process(processor_for(SAMPLED, CHI_PROMPT, VOCAB), rows, tokens, draft), SAMPLED)
    generator = torch.Generator().manual_seed(0)
    outputs = [verify_sampled(draft, probs, generator).token_ids for _ in range(TRIALS)]

    first_expected = reference_probs(rows[0], CHI_OUTPUT)
    second_expected = reference_probs(rows[1], CHI_OUTPUT + [CHI_DRAFT])
    path_blind = reference_probs(rows[1], CHI_OUTPUT)
    assert 0.5 * (second_expected - path_blind).abs().sum() > 0.3  # otherwise the test could not tell
    first = [out[0] for out in outputs]
    second = [out[1] for out in outputs if out[0] == CHI_DRAFT]
    assert 0.5 < len(second) / TRIALS < 0.9
    assert p_value(first, first_expected) > 0.001
    assert p_value(second, second_expected) > 0.001
    # min_p: tokens it cuts are never drawn.
    assert all(first_expected[t] > 0 for t in set(first)) and all(second_expected[t] > 0 for t in set(second))


@pytest.mark.parametrize("controls, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {3: 100.5}}, "logit_bias of token 3 must be in [-100, 100]"),
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
])
def test_bad_controls_are_refused(controls, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**controls)


def test_controls_the_engine_checks_are_refused(engine):
    with pytest.raises(InvalidRequest, match="min_tokens must be <= max_new_tokens"):
        GenerationParams(SamplingParams(min_tokens=5), max_new_tokens=4)
    for token in (VOCAB, -1):
        with pytest.raises(InvalidRequest, match="logit_bias token id"):
            engine.open("s", PROMPT, GenerationParams(SamplingParams(logit_bias={token: 1.0})))
    assert engine.num_live == 0


def test_proto_controls_map_to_the_domain_and_absent_ones_are_off():
    def from_proto(**sampling):
        return params_from_proto(verifier_pb2.Prefill(sampling=verifier_pb2.SamplingParams(max_new_tokens=4,
                                                                                            **sampling)))

    assert from_proto().sampling == SamplingParams()
    params = from_proto(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5, min_p=0.125,
                        logit_bias={7: -3.5}, min_tokens=2, logprobs=3)
    assert params.sampling == SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.5,
                                             min_p=0.125, logit_bias={7: -3.5}, min_tokens=2)
    assert params.logprobs == 3


BAD_PREFILLS = {
    "presence_penalty": ({"presence_penalty": 3}, "presence_penalty"),
    "repetition_penalty": ({"repetition_penalty": 0}, "repetition_penalty"),
    "min_p": ({"min_p": 2}, "min_p"),
    "logit_bias value": ({"logit_bias": {3: -200}}, "logit_bias of token 3"),
    "logit_bias token": ({"logit_bias": {VOCAB: 1}}, "logit_bias token id"),
    "min_tokens": ({"min_tokens": 5}, "min_tokens"),
}


def test_bad_controls_are_invalid_argument_through_grpc(tiny_model_dir):
    async def main():
        async with running_verifier(tiny_model_dir) as (channel, engine):
            await wait_serving(channel)
            for name, (fields, message) in BAD_PREFILLS.items():
                sampling = verifier_pb2.SamplingParams(max_new_tokens=4, **fields)
                error = await session_error(channel, prefill(sampling=sampling))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert message in error.details(), name
            assert await engine.num_live() == 0

    asyncio.run(main())
