"""Committing a step's tokens: stop tokens, budgets and finish reasons."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from verifier_service.sequence import FinishReason, GenerationParams, Sequence


def new_sequence(prompt_len: int, max_new_tokens: int, stop: set[int], max_len: int) -> Sequence:
    params = GenerationParams(max_new_tokens=max_new_tokens)
    return Sequence("s", [9] * prompt_len, params, frozenset(stop), max_len, torch.Generator())


@given(
    prompt_len=st.integers(1, 10),
    max_new_tokens=st.integers(1, 12),
    room=st.integers(1, 12),
    stop=st.sets(st.integers(0, 5), max_size=2),
    steps=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=6),
)
def test_commit_respects_stops_and_budgets(prompt_len, max_new_tokens, room, stop, steps):
    seq = new_sequence(prompt_len, max_new_tokens, stop, prompt_len + room)
    emitted = []
    for tokens in steps:
        if seq.finished:
            break
        result = seq.commit(tokens, num_accepted=len(tokens) - 1)
        assert result.token_ids == tokens[: len(result.token_ids)]
        assert result.num_accepted <= len(result.token_ids)
        assert result.committed_len == len(seq.tokens)
        emitted += result.token_ids
    assert seq.tokens == [9] * prompt_len + emitted
    assert len(emitted) <= min(max_new_tokens, room)
    assert not any(token in stop for token in emitted[:-1])
    if emitted and emitted[-1] in stop:
        assert seq.finish_reason is FinishReason.STOP
    elif len(emitted) == min(max_new_tokens, room):
        assert seq.finish_reason is FinishReason.LENGTH
    else:
        assert not seq.finished


def test_stop_token_is_kept_and_later_tokens_dropped():
    seq = new_sequence(3, 10, {4}, 100)
    result = seq.commit([1, 4, 2], num_accepted=2)
    assert result.token_ids == [1, 4]
    assert result.num_accepted == 2
    assert result.finish_reason is FinishReason.STOP
