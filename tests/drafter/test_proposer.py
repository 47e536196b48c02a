"""SequenceProposer on the compiled engine, without gRPC."""

import pytest

from drafter_service.draft import SOURCE_REQUEST
from drafter_service.engine import SESSION_BUDGET, DraftEngine, draft_from_core
from drafter_service.proposer import CommittedLengthMismatch, SequenceProposer, propose
from speclane.speculation import SpeculationSettings


def make_proposer(method="suffix", **params):
    engine = DraftEngine(max_tree_depth=16, max_cached_requests=10)
    return engine, SequenceProposer(engine, SpeculationSettings(method, 4, **params))


def draft_of(engine, proposer):
    (draft,) = propose(engine, [(proposer, SESSION_BUDGET)])
    return draft_from_core(draft)


def test_suffix_session_commits_and_drafts():
    engine, proposer = make_proposer()
    proposer.start([1, 2, 3, 4, 1, 2])
    proposer.commit([3], committed_len=7)
    draft = draft_of(engine, proposer)
    proposer.end()
    assert draft.token_ids == (4, 1, 2)  # matched "1 2 3": budget 3
    assert draft.source == SOURCE_REQUEST
    assert engine.core.active_requests() == []
    assert len(engine.core.cached_requests()) == 1


def test_ngram_session_leaves_the_suffix_cache_alone():
    engine, proposer = make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=3)
    proposer.start([5, 6, 7, 8, 5, 6])
    draft = draft_of(engine, proposer)
    proposer.commit([7], committed_len=7)
    draft_of(engine, proposer)
    proposer.end()
    assert draft.token_ids == (7, 8, 5, 6)
    assert engine.core.cached_requests() == []


def test_the_steps_proposed_together_go_to_the_core_in_one_call_each_with_its_own_tokens_and_budget():
    engine = DraftEngine(max_tree_depth=16, max_cached_requests=10)
    proposers = [SequenceProposer(engine, SpeculationSettings("suffix", 4)) for _ in range(3)]
    for offset, proposer in enumerate(proposers):
        proposer.start([offset, 1, 2, 3, 1, 2])
        proposer.commit([3] * offset, committed_len=6 + offset)
    calls = []
    step = engine.core.step
    engine.core = type("Counting", (), {"step": lambda self, ids, tokens, budgets: calls.append((ids, tokens, budgets))
                                        or step(ids, tokens, budgets)})()
    budgets = [SESSION_BUDGET, (0.5, -1.0), SESSION_BUDGET]
    drafts = [draft_from_core(draft) for draft in propose(engine, list(zip(proposers, budgets)))]
    assert calls == [([p.seq_id for p in proposers], [[], [3], [3, 3]], budgets)]
    assert all(p.uncommitted == [] for p in proposers)  # handed over once
    assert drafts[0].token_ids == (3, 1)  # matched "1 2": its budget 2


def test_length_mismatch_is_refused_and_changes_nothing():
    _, proposer = make_proposer()
    proposer.start([1, 2, 3])
    with pytest.raises(CommittedLengthMismatch):
        proposer.commit([4, 5], committed_len=6)
    assert proposer.committed_len == 3
    proposer.commit([4, 5], committed_len=5)
    assert proposer.committed_len == 5
