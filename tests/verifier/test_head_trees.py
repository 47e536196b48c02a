"""EAGLE-2 dynamic trees drafted by a head: each node's children are the head's
top choices after that node's path (the tree's attention mask and positions
are a chain's), the nodes kept are a tree, and verifying the trees keeps
greedy output and the sampled distribution exactly the target's."""

import json
import pathlib

import pytest
import torch

from tests.heads_support import write_random_head
from tests.verifier.conftest import make_engine
from tests.verifier.test_engine import SAMPLING_PROMPT, SAMPLING_TRIALS, exact_second_token, p_value
from tests.verifier.test_head_batching import pending_states, together_and_alone
from tests.verifier.test_heads import assert_head_cache_is_the_committed_pairs, generate, head_second_tokens
from verifier_service.config import TreeShape, draft_settings
from verifier_service.heads.drafting import DraftRequest, HeadDrafter, HeadState
from verifier_service.heads.dynamic_tree import _Nodes, _rerank
from verifier_service.heads.layer import HeadKV
from verifier_service.heads.loading import load_head
from verifier_service.tree import depths, is_chain

SHAPE = TreeShape(topk=3, max_nodes=10)


@pytest.fixture(scope="module", params=["eagle", "eagle3", "mtp"])
def tree_engine(request, runner, tmp_path_factory):
    """An engine whose random head of each kind drafts trees; every draft it makes is kept in `engine.drafts`."""
    directory = write_random_head(request.param, pathlib.Path(runner.model_dir),
                                  tmp_path_factory.mktemp(request.param), seed=4)
    drafter = load_head(request.param, str(directory), runner, tree=SHAPE)
    engine = make_engine(runner)
    engine.head, engine.drafts = drafter, []
    draft_many = drafter.draft_many

    def kept(*args, **kwargs):
        drafts = draft_many(*args, **kwargs)
        engine.drafts.extend(drafts)
        return drafts

    drafter.draft_many = kept
    runner.feature_layers = drafter.head.feature_layers
    yield engine
    runner.feature_layers = ()


def test_greedy_output_with_head_trees_equals_plain(tree_engine, hf_model):
    plain, _ = generate(tree_engine, 0, use_head=False)
    tree_engine.drafts.clear()
    drafted, _ = generate(tree_engine, 4, use_head=True)
    assert drafted.tokens == plain.tokens
    trees = [d for d in tree_engine.drafts if not is_chain(d.parents)]
    assert trees and all(len(d.token_ids) <= SHAPE.max_nodes for d in tree_engine.drafts)
    assert max(max(depths(d.parents)) for d in trees) >= 3  # expanded past the first level
    assert_head_cache_is_the_committed_pairs(tree_engine, hf_model, drafted)  # the expansion was rolled back


def test_sampling_with_head_trees_keeps_the_target_distribution(tree_engine, hf_model):
    """A tree is chosen without drawing, so it is judged as a deterministic
    draft: a sibling is tried with the rejected tokens' mass removed (that rule
    on likely siblings: test_tree.py). A random head's top tokens are seldom
    the target's, so here most steps take the residual path."""
    plain, _ = exact_second_token(hf_model, SAMPLING_PROMPT)
    tree_engine.drafts.clear()
    tokens, accepted = head_second_tokens(tree_engine)
    assert any(not is_chain(d.parents) for d in tree_engine.drafts)
    assert all(d.proposals is None for d in tree_engine.drafts)
    assert 0 < accepted < SAMPLING_TRIALS
    assert p_value(tokens, plain) > 0.001


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_each_nodes_children_are_the_heads_top_choices_after_its_path(runner, tmp_path, kind):
    """Every level is expanded in one batched head step; each node there must
    see exactly what a chain through its path would: the committed pairs, its
    ancestors and itself, at its own depth's position."""
    drafter = load_head(kind, str(write_random_head(kind, pathlib.Path(runner.model_dir), tmp_path, seed=6)), runner,
                        tree=TreeShape(topk=3, max_nodes=64))
    head = drafter.head
    torch.manual_seed(0)
    width = head.fc.in_features if kind == "eagle3" else head.shape.hidden_size
    features, tokens = torch.randn(6, width), [4, 8, 15, 16, 23, 42]
    state = HeadState()
    state.add(0, features, tokens)
    draft = drafter.draft(state, 4, None)
    assert len(state.kv) == len(tokens)  # rolled back to the committed pairs
    kids: dict[int, list[int]] = {}
    for node, parent in enumerate(draft.parents):
        kids.setdefault(parent, []).append(node)
    assert len(kids) >= 4  # the root and at least one node on each of three levels were expanded
    vocab = head.draft_token_ids
    for parent, children in kids.items():
        path = []
        while parent >= 0:
            path.insert(0, draft.token_ids[parent])
            parent = draft.parents[parent]
        with torch.no_grad():
            kv = HeadKV()
            hidden = head(torch.tensor(tokens), features, torch.arange(len(tokens)), kv)[-1:]
            for depth, token in enumerate(path, start=len(tokens)):
                hidden = head(torch.tensor([token]), hidden, torch.tensor([depth]), kv)
            probs = torch.softmax(head.logits(hidden)[0].float(), -1)
        third = probs.topk(3).values[-1]
        for child in children:
            token = draft.token_ids[child]
            draft_id = token if vocab is None else int((vocab == token).nonzero()[0])
            assert probs[draft_id] >= third - 1e-5


def test_a_batch_of_trees_is_what_each_sequence_drafts_alone_in_one_head_step_a_level(tree_engine):
    """Sequences of different depths and pending pairs expand their trees together: one head step a level for
    all of them, the level's choices read once, each tree equal to the one drafted alone, every cache rolled back
    to its committed pairs."""
    states = pending_states(tree_engine)
    ks = [2, 4, 3]
    together, expected, forwards, reads, alone = together_and_alone(
        tree_engine.head, states, lambda states: [DraftRequest(state, k, None) for state, k in zip(states, ks)])
    assert [(d.token_ids, d.parents) for d in together] == [(d.token_ids, d.parents) for d in expected]
    assert all(d.score == pytest.approx(e.score, rel=1e-4) for d, e in zip(together, expected))
    assert any(not is_chain(d.parents) for d in together) and len(together[1].token_ids) > 3
    # The pairs fed, then a step a level below the last (each as wide as the trees still growing), read once each.
    assert len(forwards) == 1 + 3 and forwards[1] == 3 * SHAPE.topk and reads == 4
    for batched, single in zip(states, alone):
        assert len(batched.kv) == len(single.kv) and torch.allclose(batched.kv.keys, single.kv.keys, atol=1e-5)


def test_the_rerank_keeps_the_likeliest_paths_that_pay_for_their_verification():
    nodes = _Nodes([], [], [], [])
    a = nodes.add(10, -1, 0.6)
    nodes.add(11, -1, 0.3)
    nodes.add(12, a, 0.6)  # as likely as its parent (the head was sure): still after it
    nodes.add(13, a, 0.05)
    assert _rerank(nodes, 10, 0.0) == ([0, 2, 1, 3], pytest.approx(1.55))
    assert _rerank(nodes, 2, 0.0)[0] == [0, 2]
    # A node is kept while its path probability beats cost x the worth so far, (1 + score) / (1 + cost x nodes):
    # at 0.1, 0.3 > 0.1 x 2.2 / 1.2 but 0.05 < 0.1 x 2.5 / 1.3; at 0.2, 0.3 < 0.2 x 2.2 / 1.4; at 0.7, 0.6 < 0.7.
    kept, score = _rerank(nodes, 10, 0.1)
    assert kept == [0, 2, 1] and score == pytest.approx(1.5)
    assert _rerank(nodes, 10, 0.2)[0] == [0, 2]
    assert _rerank(nodes, 10, 0.7) == ([], 0.0)


def test_the_verifier_reads_a_tree_shape_from_the_speculative_config():
    assert draft_settings('{"method": "eagle3", "eagle_topk": 4, "num_speculative_tokens": 5}').tree == TreeShape(4, 20)
    assert draft_settings('{"method": "eagle3", "eagle_topk": 4, "num_draft_tokens": 12}').tree == TreeShape(4, 12)
    assert draft_settings('{"method": "eagle3", "eagle_topk": 1}').tree is None
    for bad, message in [({"eagle_topk": 0}, "eagle_topk must be"), ({"eagle_topk": True}, "eagle_topk must be"),
                         ({"eagle_topk": 2, "num_draft_tokens": 0}, "num_draft_tokens must be")]:
        with pytest.raises(ValueError, match=message):
            draft_settings(json.dumps({"method": "eagle3", **bad}))
    with pytest.raises(ValueError, match="eagle_topk needs a head"):
        draft_settings('{"method": "suffix", "eagle_topk": 2}')


def test_a_tree_shape_is_refused_where_it_would_be_a_chain():
    with pytest.raises(ValueError, match="topk >= 2"):
        TreeShape(1, 4)
    assert HeadDrafter(object(), TreeShape(2, 4)).tree.max_nodes == 4
