"""The verifier's own draft for a step no next-round offer foresaw."""

from hypothesis import given
from hypothesis import strategies as st

from verifier_service.prompt_lookup import MAX_MATCH, lookup_draft


def longest_earlier_match(tokens: list[int], max_tokens: int) -> list[int]:
    """The rule spelled out: every earlier end position, its match length, the latest of the longest."""
    best_len, best_end = 0, 0
    for end in range(1, len(tokens)):  # tokens[:end] ends with the match; it continues at tokens[end]
        length = 0
        while length < min(end, MAX_MATCH) and tokens[end - 1 - length] == tokens[len(tokens) - 1 - length]:
            length += 1
        if length and length >= best_len:
            best_len, best_end = length, end
    return tokens[best_end:best_end + min(max_tokens, best_len)] if best_len and max_tokens > 0 else []


def test_it_continues_the_latest_of_the_longest_earlier_matches():
    #          a  b  c  X  ...  b  c  Y  ...  a  b  c
    tokens = [1, 2, 3, 10, 11, 12, 5, 2, 3, 20, 21, 22, 1, 2, 3]
    assert lookup_draft(tokens, 8) == [10, 11, 12]  # "a b c" matched 3 tokens: 3 drafted, not 8
    assert lookup_draft(tokens, 2) == [10, 11]
    assert lookup_draft([5, 2, 3, 20, 21, 5, 2, 3, 30, 31, 2, 3], 8) == [30, 31]  # "b c" twice: the latest


def test_nothing_is_drafted_where_the_last_token_is_new_or_no_tokens_are_asked_for():
    assert lookup_draft([1, 2, 3, 4], 8) == []
    assert lookup_draft([7], 8) == []
    assert lookup_draft([1, 2, 1], 0) == []


@given(st.lists(st.integers(0, 4), max_size=80), st.integers(0, 12))
def test_it_drafts_what_the_rule_says(tokens, max_tokens):
    assert lookup_draft(tokens, max_tokens) == longest_earlier_match(tokens, max_tokens)
