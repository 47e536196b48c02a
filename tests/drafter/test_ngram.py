"""N-gram prompt lookup against a direct search over all n and positions."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service.reference.ngram import propose_ngram


def oracle(context, k, min_n, max_n) -> tuple[tuple[int, ...], int]:
    """Longest n first; for it the earliest earlier occurrence; the k tokens after it."""
    end = len(context)
    for n in range(max_n, min_n - 1, -1):
        suffix = context[end - n:]
        for start in range(0, end - n):
            if n < end and context[start:start + n] == suffix:
                return tuple(context[start + n:start + n + k]), n
    return (), 0


@settings(max_examples=500, deadline=None)
@given(
    context=st.lists(st.integers(0, 2), max_size=30),
    k=st.integers(1, 6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
)
def test_matches_brute_force(context, k, min_n, extra):
    draft = propose_ngram(context, k, min_n, min_n + extra)
    assert (draft.token_ids, draft.match_len) == oracle(context, k, min_n, min_n + extra)
    assert draft.source == "ngram"
    assert draft.is_chain


def test_earliest_occurrence_of_the_longest_match_wins():
    #          0  1  2  3  4  5  6  7  8  9 10
    context = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    # "1 2 3" occurs at 0 (followed by 9); "2 3" also at 5 (followed by 8): the longer wins.
    assert propose_ngram(context, 3, 2, 3).token_ids == (9, 5, 2)
    # Capped at n = 2: both "2 3" occurrences match, the earlier one (at 1) wins.
    assert propose_ngram(context, 1, 1, 2).token_ids == (9,)


def test_no_match_gives_an_empty_draft():
    assert propose_ngram([1, 2, 3, 4], 5, 1, 3).token_ids == ()
    assert propose_ngram([1, 2, 1, 2], 5, 3, 4).token_ids == ()  # only "1 2" repeats, shorter than min_n
    assert propose_ngram([], 5, 1, 3).token_ids == ()


def test_rejects_min_n_below_one():
    with pytest.raises(ValueError):
        propose_ngram([1, 1], 2, 0, 2)
