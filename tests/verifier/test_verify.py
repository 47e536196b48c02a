"""Acceptance rules: greedy equivalence and statistical losslessness of
speculative sampling (chi-square against the target distribution p)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import chi2_contingency, chisquare

from speclane_cli.bench.verifier import OperationCount
from verifier_service.sampling import draw, draw_uniforms, greedy_choices
from verifier_service.tree import children
from verifier_service.verify import (
    SampledStep,
    Verdict,
    dense_proposals,
    sampled_decisions,
    verify_greedy,
    verify_sampled,
    verify_sampled_batch,
)

TRIALS = 10_000
P0 = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.10, 0.05])
P1 = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])
P_BONUS = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
Q0 = torch.tensor([0.10, 0.50, 0.10, 0.20, 0.05, 0.05])


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def test_greedy_accepts_all_and_adds_bonus():
    verdict = verify_greedy([4, 5, 6], [4, 5, 6, 7])
    assert verdict.token_ids == [4, 5, 6, 7]
    assert verdict.num_accepted == 3


def test_greedy_emits_argmax_at_first_mismatch():
    verdict = verify_greedy([4, 1, 6], [4, 5, 6, 7])
    assert verdict.token_ids == [4, 5]
    assert verdict.num_accepted == 1


def test_greedy_empty_draft_decodes_one_token():
    verdict = verify_greedy([], [3])
    assert verdict.token_ids == [3]
    assert verdict.num_accepted == 0


@given(st.data())
def test_greedy_output_is_the_argmax_walk(data):
    k = data.draw(st.integers(0, 6))
    targets = data.draw(st.lists(st.integers(0, 7), min_size=k + 1, max_size=k + 1))
    draft = data.draw(st.lists(st.integers(0, 7), min_size=k, max_size=k))
    verdict = verify_greedy(draft, targets)
    n = verdict.num_accepted
    assert draft[:n] == targets[:n]
    assert n == k or draft[n] != targets[n]
    assert verdict.token_ids == [*targets[:n], targets[n]]


def p_value(tokens: list[int], p: torch.Tensor) -> float:
    counts = np.bincount(tokens, minlength=len(p))
    expected = p.double().numpy()
    return chisquare(counts, len(tokens) * expected / expected.sum()).pvalue


def run_trials(step, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [step(generator) for _ in range(TRIALS)]


def deterministic_step(generator):
    return verify_sampled([1, 2], torch.stack([P0, P1, P_BONUS]), generator).token_ids


def test_sampling_without_proposals_is_lossless():
    outputs = run_trials(deterministic_step)
    assert p_value([out[0] for out in outputs], P0) > 0.001
    # Given the first draft token was kept, the next token must follow p1.
    after_accept = [out[1] for out in outputs if out[0] == 1 and len(out) > 1]
    assert len(after_accept) == sum(out[0] == 1 for out in outputs)
    assert p_value(after_accept, P1) > 0.001


def test_chi_square_detects_wrong_rules_without_proposals():
    always_accept = run_trials(lambda g: [1])
    assert p_value([out[0] for out in always_accept], P0) < 1e-6

    def resample_without_removing_draft(generator):
        accept = torch.rand((), generator=generator) < P0[1]
        return [1] if accept else [sample(P0, generator)]

    assert p_value([out[0] for out in run_trials(resample_without_removing_draft)], P0) < 1e-6


def proposal_step(generator):
    draft = sample(Q0, generator)  # a sampling drafter draws its token from q
    return verify_sampled([draft], torch.stack([P0, P_BONUS]), generator, Q0[None]).token_ids


def test_sampling_with_proposals_is_lossless():
    outputs = run_trials(proposal_step)
    assert p_value([out[0] for out in outputs], P0) > 0.001


def test_chi_square_detects_wrong_rule_with_proposals():
    def reject_to_plain_p(generator):
        draft = sample(Q0, generator)
        if torch.rand((), generator=generator) < P0[draft] / Q0[draft]:
            return [draft]
        return [sample(P0, generator)]

    assert p_value([out[0] for out in run_trials(reject_to_plain_p)], P0) < 1e-6


def test_identical_p_and_q_always_accept():
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        draft = sample(P0, generator)
        verdict = verify_sampled([draft], torch.stack([P0, P_BONUS]), generator, P0[None])
        assert verdict.num_accepted == 1


def test_dense_proposals_sums_duplicates_and_normalises():
    dense = dense_proposals([((1, 3, 1), (0.2, 0.4, 0.2)), ((0,), (0.5,))], 4, torch.device("cpu"))
    assert torch.allclose(dense, torch.tensor([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]]))


# Root children 0, 1 and 5 (5 repeats 0's token); node 0's children 2 and 3; node 1's child 4.
TREE_DRAFT = (0, 2, 2, 4, 1, 0)
TREE_PARENTS = (-1, -1, 0, 0, 1, -1)
TREE_TRIALS = 4_000  # for each rule
TREE_ROWS = torch.stack([P0, P1, P_BONUS, Q0, P0.flip(0), P1.flip(0), P_BONUS.flip(0)])


def one_node_at_a_time(draft, probs, generator, proposals, parents) -> Verdict:
    """The rule as SpecInfer states it, a random draw per node tried: the oracle the vectorized walk must
    match in distribution."""
    kids = children(parents)
    path, row = [], 0
    while True:
        p = probs[row]
        for child in kids[row]:
            token = draft[child]
            accept = p[token] if proposals is None else p[token] / proposals[child, token]
            if torch.rand((), generator=generator) < accept:
                path.append(child)
                break
            residual = p.clone() if proposals is None else (p - proposals[child]).clamp_min(0.0)
            if proposals is None:
                residual[token] = 0.0
            p = residual / residual.sum() if residual.sum() > 0 else p
        else:
            return Verdict([draft[i] for i in path] + [sample(p, generator)], len(path), path)
        row = path[-1] + 1


@pytest.mark.parametrize("proposals", [None, torch.stack([Q0, Q0, P1, P1, P0, Q0])], ids=["one-hot", "dense"])
def test_a_sampled_tree_is_distributed_as_the_walk_that_draws_per_node(proposals):
    """The tree's decisions are drawn at once on the device (one copy to the host): the joint outcome (path
    and emitted token) has the one-at-a-time walk's distribution, and the first token the target's (with
    proposals, each node's token drawn from its own; the root's three children i.i.d. from one)."""
    def outcomes(rule, seed):
        generator = torch.Generator().manual_seed(seed)
        runs = []
        for _ in range(TREE_TRIALS):
            draft = TREE_DRAFT if proposals is None else [sample(q, generator) for q in proposals]
            runs.append(tuple(rule(draft, TREE_ROWS, generator, proposals, TREE_PARENTS).token_ids))
        return runs

    vectorized, oracle = outcomes(verify_sampled, 5), outcomes(one_node_at_a_time, 6)
    assert p_value([out[0] for out in vectorized], P0) > 0.001
    kinds = sorted(set(vectorized) | set(oracle))
    table = np.array([[runs.count(kind) for kind in kinds] for runs in (vectorized, oracle)])
    common = table.sum(0) >= 10  # the rest pooled, so every expected count is large enough
    table = np.column_stack([table[:, common], table[:, ~common].sum(1)]) if (~common).any() else table
    assert chi2_contingency(table).pvalue > 0.001
    assert any(len(out) == 3 for out in vectorized)  # the walk reaches the tree's second level


def test_a_pass_of_sampled_steps_judges_each_as_it_would_be_judged_alone():
    """Decodes, deterministic chains of several lengths, a chain with proposals and trees of two shapes with and
    without proposals, their rows packed in one tensor as a pass lays them out: each step's verdict is the one it
    gets alone with its generator in the same state, so a seeded request does not depend on what shares its
    pass; and the batch reads the host once, where each step alone reads it once."""
    chain_rows = [torch.stack([P0, P1, P_BONUS]), torch.stack([P_BONUS]), torch.stack([P1, P0, Q0, P_BONUS])]
    layouts = [  # (draft, rows, proposals, parents)
        ([1, 2], chain_rows[0], None, None),
        ([], chain_rows[1], None, None),
        ([2, 0, 4], chain_rows[2], None, None),
        ([1], torch.stack([P0, P_BONUS]), Q0[None], None),
        (list(TREE_DRAFT), TREE_ROWS, None, TREE_PARENTS),
        ([0], torch.stack([P1, P0]), None, None),
        ([1, 1, 3, 0, 2, 1], TREE_ROWS.flip(0), torch.stack([Q0, Q0, P1, P1, P0, Q0]), TREE_PARENTS),
        ([1, 2, 4], torch.stack([P0, P1, Q0, P_BONUS]), P_BONUS.expand(3, -1), (-1, -1, 0)),
        ([3, 1, 1], torch.stack([P0, P_BONUS, P1, Q0]), None, (-1, -1, 1)),
    ]
    probs = torch.cat([rows for _, rows, _, _ in layouts])
    starts = np.cumsum([0] + [len(rows) for _, rows, _, _ in layouts])[:-1]
    copies = []
    original = torch.Tensor.tolist

    def counted(tensor):
        copies.append(tensor.numel())
        return original(tensor)

    for trial in range(200):
        steps = [SampledStep(draft, int(start), torch.Generator().manual_seed(trial * 10 + i), proposals, parents)
                 for i, ((draft, _, proposals, parents), start) in enumerate(zip(layouts, starts))]
        torch.Tensor.tolist = counted
        try:
            together = verify_sampled_batch(probs, steps)
            assert len(copies) == 1
            alone = [verify_sampled(draft, rows, torch.Generator().manual_seed(trial * 10 + i), proposals, parents)
                     for i, (draft, rows, proposals, parents) in enumerate(layouts)]
            assert len(copies) == 1 + len(layouts)
        finally:
            torch.Tensor.tolist = original
        copies.clear()
        assert together == alone


def test_the_batch_keeps_each_steps_distribution():
    """Two deterministic chains in one batch: the second's first token follows its own first row (P1), so
    no row or uniform is read from the wrong step."""
    probs = torch.stack([P0, P_BONUS, P1, P_BONUS])
    generator = torch.Generator().manual_seed(7)
    firsts = [verify_sampled_batch(probs, [SampledStep([0], 0, generator), SampledStep([3], 2, generator)])[1]
              .token_ids[0] for _ in range(TRIALS)]
    assert p_value(firsts, P1) > 0.001


def test_chains_with_proposals_decided_together_each_keep_their_target():
    """Chains drafted from proposals (2 tokens from Q0 then P_BONUS's q, and 1 from P1-like q) around a
    deterministic one, decided together: each chain's tokens follow its own target rows, so none reads another's
    proposals, rows or uniforms; the first chain's second token, after its first was kept, follows P1."""
    q_b = torch.tensor([0.30, 0.05, 0.25, 0.05, 0.30, 0.05])
    probs = torch.stack([P0, P1, P_BONUS, P_BONUS, P1, P_BONUS])
    generator = torch.Generator().manual_seed(11)
    firsts, seconds, thirds = [], [], []
    for _ in range(TRIALS):
        a = [sample(Q0, generator), sample(P_BONUS, generator)]
        b = [sample(q_b, generator)]
        verdicts = verify_sampled_batch(probs, [
            SampledStep(a, 0, generator, torch.stack([Q0, P_BONUS])),
            SampledStep([], 3, generator),
            SampledStep(b, 4, generator, q_b[None])])
        firsts.append(verdicts[0].token_ids[0])
        if verdicts[0].num_accepted >= 1:
            seconds.append(verdicts[0].token_ids[1])
        thirds.append(verdicts[2].token_ids[0])
    assert p_value(firsts, P0) > 0.001 and p_value(thirds, P1) > 0.001
    assert len(seconds) > TRIALS / 4 and p_value(seconds, P1) > 0.001


@pytest.mark.parametrize("kind", ["chains", "trees"])
def test_a_pass_decides_its_steps_in_operations_their_number_does_not_change(kind):
    """On an accelerator each operation is a kernel launch: chains, and trees, with and without proposals, are
    decided together. Unseeded steps share one generator and add nothing; a seeded step adds the one draw of its
    own uniforms."""
    draft, parents, rows = ([1, 3], None, [P0, P1, P_BONUS]) if kind == "chains" else (
        list(TREE_DRAFT), TREE_PARENTS, list(TREE_ROWS))
    shared = torch.Generator().manual_seed(0)

    def operations(count: int, seeded: bool) -> int:
        steps = []
        for i in range(count):
            proposals = Q0[None].expand(len(draft), -1) if i % 2 else None
            generator = torch.Generator().manual_seed(i) if seeded else shared
            steps.append(SampledStep(draft, len(rows) * i, generator, proposals, parents))
        with OperationCount() as counted:
            sampled_decisions(torch.stack(rows * count), steps)
        return counted.count

    assert operations(12, seeded=False) == operations(4, seeded=False)
    assert operations(12, seeded=True) - operations(4, seeded=True) == 8


def test_draw_uniforms_draws_once_a_generator_in_each_steps_order():
    """The uniforms of steps that share a generator come from one draw of it, in the steps' order; a seeded
    step's are what its own generator gives alone, whatever shares the pass."""
    shared, own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    drawn = draw_uniforms([2, 3, 1, 2], [shared, own, shared, shared], torch.device("cpu"))
    expected_shared = torch.rand(5, generator=torch.Generator().manual_seed(1))
    expected_own = torch.rand(3, generator=torch.Generator().manual_seed(2))
    assert torch.equal(drawn, torch.cat([expected_shared[:2], expected_own, expected_shared[2:]]))
    assert torch.equal(draw_uniforms([3], [own], torch.device("cpu")),
                       torch.rand(6, generator=torch.Generator().manual_seed(2))[3:])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, None], ids=["float64", "float32", "cpu kernel"])
def test_draw_follows_each_rows_distribution_and_never_a_token_without_mass(dtype):
    rows = torch.stack([P0, torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0]) * 3])  # the second unnormalised
    generator = torch.Generator().manual_seed(0)
    drawn = [draw(rows, torch.rand(2, generator=generator), dtype).tolist() for _ in range(TRIALS)]
    assert p_value([first for first, _ in drawn], P0) > 0.001
    assert {second for _, second in drawn} == {1, 3}
    edges = draw(rows[1:].expand(2, -1), torch.tensor([0.0, 1.0 - 2 ** -24]), dtype)
    assert edges.tolist() == [1, 3]  # the extremes of [0, 1) land on the first and last token with mass
    trailing = torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0]])  # the largest uniform stops at the last token with mass
    assert draw(trailing, torch.tensor([1.0 - 2 ** -24]), dtype).tolist() == [2]


def test_the_cpu_kernel_draws_the_token_the_float64_cumulative_sum_finds():
    """Wide rows (the kernel sums 16 tokens at a time), a third of their tokens without mass and a tail of zeros,
    at uniforms spread over [0, 1) and at its ends: the kernel's token is the float64 cumulative sum's, with mass,
    and rows without mass (zero, NaN, infinite) stay in the vocabulary."""
    generator = torch.Generator().manual_seed(4)
    rows = torch.softmax(torch.randn(300, 1_003, generator=generator) * 4, -1)
    rows[:, ::3] = 0.0
    rows[:, -40:] = 0.0
    uniforms = torch.cat([torch.rand(296, generator=generator), torch.tensor([0.0, 1 - 2 ** -24, 0.5, 0.999])])
    drawn = draw(rows, uniforms)
    assert torch.equal(drawn, draw(rows, uniforms, torch.float64))
    assert (rows.gather(1, drawn[:, None]) > 0).all()
    empty = torch.stack([torch.zeros(1_003), torch.full((1_003,), math.nan), rows[0].clone().fill_(math.inf)])
    assert draw(empty, torch.full((3,), 0.5)).tolist() == [1_002] * 3


def test_a_step_with_no_mass_to_draw_from_fails_alone():
    probs = torch.stack([P0, P_BONUS, torch.full_like(P0, float("nan")), torch.zeros_like(P0)])
    generator = torch.Generator().manual_seed(0)
    verdicts = verify_sampled_batch(probs, [SampledStep([], 0, generator), SampledStep([], 1, generator),
                                            SampledStep([], 2, generator), SampledStep([], 3, generator)])
    assert [type(verdict) for verdict in verdicts] == [Verdict, Verdict, RuntimeError, RuntimeError]
    with pytest.raises(RuntimeError, match="no finite mass"):
        verify_sampled([], probs[2:3], generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_choices_pick_the_row_maxima_as_argmax_does(dtype):
    """The CPU kernel (csrc/greedy.cc) in both dtypes: ties, NaNs, -inf rows, signed zeros, a maximum in a row's
    tail past its last whole vector, rows read in place from a wider tensor."""
    generator = torch.Generator().manual_seed(0)
    wide = torch.randint(-2, 3, (40, 1010), generator=generator).to(dtype)  # every row has ties for its maximum
    logits = wide[:, :1000]  # 1000 = 62 vectors of 16 and a tail of 8
    logits[3, [7, 500]] = float("nan")
    logits[4, 999] = float("nan")
    logits[5] = float("-inf")
    logits[6] = -0.0
    logits[6, 40] = 0.0
    logits[7, 995] = 9.0
    logits[8, [30, 600]] = float("inf")
    choices = greedy_choices(logits)
    assert torch.equal(choices, torch.argmax(logits, dim=-1))
    assert choices[3] == 7 and choices[4] == 999 and choices[5] == 0 and choices[7] == 995 and choices[8] == 30
    vocab = torch.randn(3, 151_936, generator=generator).to(dtype)  # Qwen2.5's rows, one at a time too
    assert torch.equal(greedy_choices(vocab), torch.argmax(vocab, dim=-1))
    assert torch.equal(greedy_choices(vocab[1:2]), torch.argmax(vocab[1:2], dim=-1))
