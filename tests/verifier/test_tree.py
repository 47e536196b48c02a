"""Tree drafts: verified in one pass with an ancestor mask, the longest
accepted path kept and the KV compacted to it; greedy equals plain decoding,
sampling is distributed as plain sampling (with and without proposals)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verifier_service.sampling import SamplingParams
from verifier_service.sequence import Draft, GenerationParams, Proposal
from verifier_service.tree import ancestor_mask, depths, keep_nodes
from verifier_service.verify import verify_greedy

from .conftest import VOCAB
from .test_engine import (
    GREEDY,
    PROMPT,
    SAMPLING_PROMPT,
    SAMPLING_TRIALS,
    assert_kv_matches_a_fresh_forward,
    exact_second_token,
    p_value,
    reference,
    wrong,
)


def decoy_tree(future: list[int]) -> Draft:
    """Two wrong branches, then the right path as the third child of the root:
    root -> [wrong a, wrong b -> x, right0 -> right1 -> right2, right1' (wrong)]."""
    tokens = [wrong(future[0]), wrong(wrong(future[0])), 7, future[0], future[1], wrong(future[2]), future[2]]
    parents = [-1, -1, 1, -1, 3, 4, 4]
    return Draft(tuple(tokens), tuple(parents))


def test_greedy_tree_speculation_equals_generate_and_compacts_the_kv(engine, runner, hf_model):
    ref = reference(hf_model, PROMPT, 24)
    seq = engine.open("s", PROMPT, GenerationParams(GREEDY, max_new_tokens=24, ignore_eos=True))
    engine.prefill(seq)
    accepted = []
    while not seq.finished:
        future = ref[seq.num_generated:]
        draft = decoy_tree(future) if len(future) > 3 else Draft()
        step = engine.verify(seq, draft)
        accepted.append(step.num_accepted)
        if not seq.finished:
            engine.step()  # an idle pass applies the queued compaction
            assert_kv_matches_a_fresh_forward(runner, hf_model, seq)
    assert seq.tokens[len(PROMPT):] == ref
    assert accepted[0] == 3  # the path through the third branch


def test_tree_helpers():
    parents = (-1, -1, 1, -1, 3, 4, 4)
    assert depths(parents) == [1, 1, 2, 1, 2, 3, 3]
    mask = ancestor_mask(parents)
    assert mask[5].nonzero().flatten().tolist() == [3, 4, 5]
    assert mask[2].nonzero().flatten().tolist() == [1, 2]
    assert keep_nodes(parents, [0, 3, 4, 6]) == (-1, -1, 1, 2)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-1, 10), min_size=1, max_size=10), st.data())
def test_greedy_tree_walk_accepts_a_longest_matching_path(raw_parents, data):
    parents = [min(p, i - 1) for i, p in enumerate(raw_parents)]
    k = len(parents)
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
    targets = data.draw(st.lists(st.integers(0, 3), min_size=k + 1, max_size=k + 1))
    verdict = verify_greedy(tokens, targets, parents)
    # The path is a chain of parent links whose tokens match the target of their parent's row.
    node = -1
    for child in verdict.path:
        assert parents[child] == node and tokens[child] == targets[node + 1]
        node = child
    assert verdict.token_ids[-1] == targets[node + 1]
    assert not any(parents[c] == node and tokens[c] == targets[node + 1] for c in range(k))


def second_tokens(engine, make_draft) -> list[int]:
    tokens = []
    rng = np.random.default_rng(0)
    for seed in range(SAMPLING_TRIALS):
        params = GenerationParams(SamplingParams(temperature=1.0, seed=seed), max_new_tokens=8, ignore_eos=True)
        seq = engine.open("s", SAMPLING_PROMPT, params)
        engine.prefill(seq)
        tokens.append(engine.verify(seq, make_draft(rng)).token_ids[0])
        engine.close(seq)
    return tokens


def test_sampled_tree_without_proposals_matches_plain_sampling(engine, hf_model):
    plain, coin_flip = exact_second_token(hf_model, SAMPLING_PROMPT)
    first, second = np.argsort(coin_flip)[-2:].tolist()
    tokens = second_tokens(engine, lambda rng: Draft((first, second, 5), (-1, -1, 0)))
    assert 0.1 < (tokens.count(first) + tokens.count(second)) / SAMPLING_TRIALS < 0.95
    assert p_value(tokens, plain) > 0.001


@pytest.mark.parametrize("mix", [0.3, 0.9])
def test_sampled_tree_with_proposals_matches_plain_sampling(engine, hf_model, mix):
    """Siblings drawn i.i.d. from q and declared with q: min(1, p/q) and the residual keep p."""
    plain, _ = exact_second_token(hf_model, SAMPLING_PROMPT)
    q = mix * plain + (1 - mix) / VOCAB
    q = q / q.sum()
    proposal = Proposal(tuple(range(VOCAB)), tuple(float(x) for x in q))

    def draft(rng):
        siblings = rng.choice(VOCAB, size=3, p=q).tolist()
        return Draft(tuple(siblings), (-1, -1, -1), proposals=(proposal,) * 3)

    assert p_value(second_tokens(engine, draft), plain) > 0.001
