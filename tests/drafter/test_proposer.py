"""SequenceProposer and ProposerParams, without gRPC."""

import pytest

from drafter_service.proposer import CommittedLengthMismatch, ProposerParams, SequenceProposer
from drafter_service.suffix_decoding import SuffixDecodingCache


def make_proposer(method="suffix", **params):
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    return cache, SequenceProposer(cache, "seq-0", ProposerParams(method, 4, **params))


def test_suffix_session_commits_and_drafts():
    cache, proposer = make_proposer()
    proposer.start([1, 2, 3, 4, 1, 2])
    proposer.commit([3], committed_len=7)
    draft = proposer.propose()
    assert draft.token_ids == (4, 1, 2)  # matched "1 2 3": budget 3
    proposer.end()
    assert cache.active_requests == frozenset()
    assert cache.cached_requests == {"seq-0"}


def test_ngram_session_leaves_the_suffix_cache_alone():
    cache, proposer = make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=3)
    proposer.start([5, 6, 7, 8, 5, 6])
    assert proposer.propose().token_ids == (7, 8, 5, 6)
    proposer.commit([7], committed_len=7)
    proposer.end()
    assert cache.cached_requests == frozenset()


def test_length_mismatch_is_refused_and_changes_nothing():
    _, proposer = make_proposer()
    proposer.start([1, 2, 3])
    with pytest.raises(CommittedLengthMismatch):
        proposer.commit([4, 5], committed_len=6)
    assert proposer.committed_len == 3
    proposer.commit([4, 5], committed_len=5)
    assert proposer.tokens == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("kwargs", [
    dict(method="eagle"),
    dict(num_speculative_tokens=0),
    dict(num_speculative_tokens=65),
    dict(prompt_lookup_min=4, prompt_lookup_max=3),
    dict(prompt_lookup_min=0),
    dict(min_token_prob=1.5),
    dict(max_spec_factor=float("nan")),
    dict(max_tree_depth=0),
])
def test_invalid_params_are_rejected(kwargs):
    values = dict(method="suffix", num_speculative_tokens=4) | kwargs
    with pytest.raises(ValueError):
        ProposerParams(**values)
