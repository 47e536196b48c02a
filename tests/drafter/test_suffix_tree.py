"""SuffixTree against a brute-force oracle built on pattern occurrence counts."""

import gc
import math
import weakref
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service.draft import Draft
from drafter_service.reference.suffix_tree import SuffixTree

tokens = st.integers(min_value=0, max_value=3)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3), st.lists(tokens, max_size=8)),
        st.tuples(st.just("repeat"), st.integers(0, 3), st.integers(1, 12)),  # re-append a tail: shared paths
        st.tuples(st.just("remove"), st.integers(0, 3)),
    ),
    max_size=12,
)


def build(max_depth: int, ops) -> tuple[SuffixTree, dict[int, list[int]]]:
    """Applies the operations to a tree and to a plain model of the stored sequences."""
    tree, model = SuffixTree(max_depth), {}
    for op in ops:
        seq_id = op[1]
        if op[0] in ("append", "repeat"):
            if seq_id not in model:
                tree.add_sequence(seq_id)
                model[seq_id] = []
            new = op[2] if op[0] == "append" else model[seq_id][-op[2]:]
            tree.append(seq_id, new)
            model[seq_id].extend(new)
        elif seq_id in model:
            tree.remove_sequence(seq_id)
            del model[seq_id]
    return tree, model


def occurrence_counts(sequences, max_depth: int) -> Counter:
    counts = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + max_depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def followers(counts: Counter, pattern: tuple) -> list[tuple[int, int]]:
    return [(key[-1], count) for key, count in counts.items() if len(key) == len(pattern) + 1 and key[:-1] == pattern]


def oracle_path(counts, pattern, budget, min_token_prob, max_depth, reanchor):
    token_ids, probs, prob = [], [], 1.0
    while len(token_ids) < budget:
        if reanchor and len(pattern) == max_depth and max_depth // 2:
            pattern = pattern[-(max_depth // 2):]  # the trie ends, not the text: condition on a shorter tail
        if not followers(counts, pattern):
            break
        token, count = min(followers(counts, pattern), key=lambda f: (-f[1], f[0]))  # ties: smaller token
        prob = prob * (count / counts[pattern])
        if prob < min_token_prob:
            break
        token_ids.append(token)
        probs.append(prob)
        pattern += (token,)
    return token_ids, list(range(-1, len(token_ids) - 1)), probs


def oracle_tree(counts, pattern, budget, min_token_prob, max_depth, reanchor):
    """All continuations with path prob >= min, ordered by (prob desc, path asc), first `budget`."""
    nodes, stack = [], [((), 1.0)]
    while stack:
        path, prob = stack.pop()
        for token, count in followers(counts, pattern + path):
            child_prob = prob * (count / counts[pattern + path])
            if child_prob >= min_token_prob:
                nodes.append((-child_prob, path + (token,)))
                stack.append((path + (token,), child_prob))
    chosen = sorted(nodes)[:max(budget, 0)]
    index_of = {path: i for i, (_, path) in enumerate(chosen)}
    return ([path[-1] for _, path in chosen], [index_of.get(path[:-1], -1) for _, path in chosen],
            [-neg for neg, _ in chosen])


def oracle_speculate(counts, max_depth, context, k, factor, offset, min_token_prob, use_tree, reanchor) -> Draft:
    candidates = []
    for match_len in range(1, min(len(context), max_depth) + 1):
        pattern = tuple(context[len(context) - match_len:])
        if counts[pattern] == 0:
            continue
        longer = tuple(context[len(context) - match_len - 1:])
        if match_len < min(len(context), max_depth) and counts[longer] == counts[pattern]:
            continue  # the same occurrences as the longer match: not drafted again
        budget = min(k, math.floor(factor * match_len + offset))
        draft = (oracle_tree if use_tree else oracle_path)(counts, pattern, budget, min_token_prob, max_depth, reanchor)
        score = sum(draft[2])
        candidates.append(((score, match_len), Draft(*map(tuple, draft), score, match_len)))
    return max(candidates, key=lambda c: c[0])[1] if candidates else Draft()


@settings(max_examples=300, deadline=None)
@given(max_depth=st.integers(1, 6), ops=operations)
def test_node_counts_equal_occurrence_counts(max_depth, ops):
    tree, model = build(max_depth, ops)
    expected = occurrence_counts(model.values(), max_depth)
    assert tree.pattern_counts() == expected  # no pattern outlives its last occurrence
    for pattern, count in expected.items():
        assert tree.count(pattern) == count


@settings(max_examples=400, deadline=None)
@given(
    max_depth=st.integers(1, 6),
    ops=operations,
    context=st.lists(tokens, max_size=10),
    k=st.integers(1, 8),
    factor=st.sampled_from([0.5, 1.0, 1.5, 3.0]),
    offset=st.sampled_from([-1.0, 0.0, 1.0, 2.5]),
    min_token_prob=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
    use_tree=st.booleans(),
    reanchor=st.booleans(),
)
def test_speculate_matches_oracle(max_depth, ops, context, k, factor, offset, min_token_prob, use_tree, reanchor):
    tree, model = build(max_depth, ops)
    counts = occurrence_counts(model.values(), max_depth)
    got = tree.speculate(context, k, factor, offset, min_token_prob, use_tree, reanchor)
    assert got == oracle_speculate(counts, max_depth, context, k, factor, offset, min_token_prob, use_tree, reanchor)


def test_most_frequent_child_ties_go_to_smaller_token():
    tree = SuffixTree(4)
    tree.add_sequence("s")
    tree.append("s", [7, 9, 7, 4])
    draft = tree.speculate([7], max_spec_tokens=1, min_token_prob=0.0)
    assert draft.token_ids == (4,)
    tree.append("s", [7, 9])  # now 9 follows 7 twice
    assert tree.speculate([7], max_spec_tokens=1, min_token_prob=0.0).token_ids == (9,)


def test_repeated_sequence_drafts_its_continuation():
    tree = SuffixTree(24)
    tree.add_sequence(0)
    tree.append(0, [1, 2, 3, 4, 5] * 3)
    draft = tree.speculate([9, 1, 2, 3], max_spec_tokens=8)
    # Budget = floor(max_spec_factor * match_len) = 3.
    assert draft.token_ids == (4, 5, 1)
    assert draft.match_len == 3
    assert draft.score == sum(draft.probs) > 2


def test_tree_mode_returns_branches():
    tree = SuffixTree(8)
    for seq_id, sequence in enumerate([[1, 2, 5], [1, 2, 6], [1, 3, 7]]):
        tree.add_sequence(seq_id)
        tree.append(seq_id, sequence)
    draft = tree.speculate([1], max_spec_tokens=4, max_spec_offset=3, min_token_prob=0.0, use_tree=True)
    # After 1: 2 (p 2/3), then 2->5, 2->6 and 3 all at p 1/3, ties to the smaller token path.
    assert draft.token_ids == (2, 5, 6, 3)
    assert draft.parents == (-1, 0, 0, -1)
    assert not draft.is_chain


def test_remove_sequence_frees_all_nodes():
    tree = SuffixTree(5)
    for seq_id in range(3):
        tree.add_sequence(seq_id)
        tree.append(seq_id, [seq_id, 1, 2, 3, 1, 2])
    for seq_id in range(3):
        tree.remove_sequence(seq_id)
    assert tree.num_nodes == 0
    assert tree.speculate([1, 2], max_spec_tokens=4) == Draft()


def test_tokens_at_exactly_min_token_prob_are_drafted():
    tree = SuffixTree(4)
    tree.add_sequence(0)
    tree.append(0, [1, 2, 1, 3])
    # After 1 comes 2 or 3, each with probability 1/2.
    assert tree.speculate([1], max_spec_tokens=1, min_token_prob=0.5).token_ids == (2,)
    assert tree.speculate([1], max_spec_tokens=1, min_token_prob=0.51).token_ids == ()


def test_edges_are_compressed():
    tree = SuffixTree(24)
    tree.add_sequence(0)
    novel = list(range(1000, 1300))
    tree.append(0, novel)
    assert tree.num_nodes == 300  # one leaf per suffix, not one node per (suffix, depth)
    tree.append(0, novel)
    tree.add_sequence(1)
    tree.append(1, novel)
    assert tree.num_nodes < 350  # repeats only raise counts along existing edges


def test_removed_sequence_storage_is_released():
    tree = SuffixTree(6)
    for seq_id in ("old", "new"):
        tree.add_sequence(seq_id)
        tree.append(seq_id, [1, 2, 3, 4, 5, 1, 2, 3])
    storage = weakref.ref(tree._sequences["old"].tokens)
    tree.remove_sequence("old")
    gc.collect()
    # Nodes "old" labelled and "new" still uses now read from a copy of their path.
    assert storage() is None
    assert tree.speculate([1, 2], max_spec_tokens=2) == Draft((3, 4), (-1, 0), (1.0, 0.5), 1.5, 2)
