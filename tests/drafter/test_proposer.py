"""SequenceProposer on the compiled engine, without gRPC."""

import asyncio

import pytest

from drafter_service.draft import SOURCE_REQUEST
from drafter_service.engine import DraftEngine
from drafter_service.proposer import CommittedLengthMismatch, SequenceProposer
from speclane.speculation import SpeculationSettings


def make_proposer(method="suffix", **params):
    engine = DraftEngine(max_tree_depth=16, max_cached_requests=10)
    return engine, SequenceProposer(engine, SpeculationSettings(method, 4, **params))


def test_suffix_session_commits_and_drafts():
    async def main():
        engine, proposer = make_proposer()
        proposer.start([1, 2, 3, 4, 1, 2])
        proposer.commit([3], committed_len=7)
        draft = await proposer.propose()
        proposer.end()
        return engine, draft

    engine, draft = asyncio.run(main())
    assert draft.token_ids == (4, 1, 2)  # matched "1 2 3": budget 3
    assert draft.source == SOURCE_REQUEST
    assert engine.core.active_requests() == []
    assert len(engine.core.cached_requests()) == 1


def test_ngram_session_leaves_the_suffix_cache_alone():
    async def main():
        engine, proposer = make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=3)
        proposer.start([5, 6, 7, 8, 5, 6])
        draft = await proposer.propose()
        proposer.commit([7], committed_len=7)
        await proposer.propose()
        proposer.end()
        return engine, draft

    engine, draft = asyncio.run(main())
    assert draft.token_ids == (7, 8, 5, 6)
    assert engine.core.cached_requests() == []


def test_steps_of_one_loop_turn_share_one_batch():
    async def main():
        engine = DraftEngine(max_tree_depth=16, max_cached_requests=10)
        proposers = [SequenceProposer(engine, SpeculationSettings("suffix", 4)) for _ in range(3)]
        for offset, proposer in enumerate(proposers):
            proposer.start([offset, 1, 2, 3, 1, 2])
        calls = []
        step = engine.core.step
        engine.core = type("Counting", (), {"step": lambda self, ids, tokens, budgets: calls.append(ids)
                                            or step(ids, tokens, budgets)})()
        drafts = await asyncio.gather(*(proposer.propose() for proposer in proposers))
        return calls, drafts

    calls, drafts = asyncio.run(main())
    assert len(calls) == 1 and len(calls[0]) == 3
    assert all(draft.token_ids == (3, 1) for draft in drafts)


def test_length_mismatch_is_refused_and_changes_nothing():
    _, proposer = make_proposer()
    proposer.start([1, 2, 3])
    with pytest.raises(CommittedLengthMismatch):
        proposer.commit([4, 5], committed_len=6)
    assert proposer.committed_len == 3
    proposer.commit([4, 5], committed_len=5)
    assert proposer.committed_len == 5
