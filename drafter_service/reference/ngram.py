"""N-gram prompt lookup (vLLM v1 semantics): find the longest n in [min_n, max_n]
such that the context's last n tokens occurred earlier in the context, take the
EARLIEST such occurrence, and draft the up to k tokens that followed it.

One pass of Knuth-Morris-Pratt over the context read backwards: the pattern is
the last max_n tokens newest first, so the matcher's state at each earlier
position is the length of the longest suffix of the context occurring there.
"""

from collections.abc import Sequence

from drafter_service.draft import SOURCE_NGRAM, Draft
from protos.conventions import chain_parents


def _failure_function(pattern: Sequence[int]) -> list[int]:
    """fail[i]: length of the longest proper border of pattern[:i + 1]."""
    fail = [0] * len(pattern)
    border = 0
    for i in range(1, len(pattern)):
        while border and pattern[i] != pattern[border]:
            border = fail[border - 1]
        if pattern[i] == pattern[border]:
            border += 1
        fail[i] = border
    return fail


def propose_ngram(context: Sequence[int], k: int, min_n: int, max_n: int) -> Draft:
    """Draft of up to k tokens by prompt lookup; empty when no n-gram matches. O(len(context))."""
    if min_n < 1:
        raise ValueError("min_n must be >= 1")
    end = len(context)
    max_n = min(max_n, end - 1)  # an occurrence must start before the suffix itself
    if k < 1 or max_n < min_n:
        return Draft(source=SOURCE_NGRAM)
    pattern = [context[end - 1 - i] for i in range(max_n)]
    fail = _failure_function(pattern)
    best_len, best_back = 0, 0
    state = 0
    # back = distance from the last token; the window context[end-1-back : end-1-back+state]
    # equals the context's last `state` tokens.
    for back in range(1, end):
        token = context[end - 1 - back]
        while state and pattern[state] != token:
            state = fail[state - 1]
        if pattern[state] == token:
            state += 1
        if state >= best_len:  # ">=" moves ties to the earlier occurrence
            best_len, best_back = state, back
        if state == max_n:
            state = fail[state - 1]
    if best_len < min_n:
        return Draft(source=SOURCE_NGRAM)
    follow = end - 1 - best_back + best_len
    token_ids = tuple(context[follow:follow + k])
    return Draft(token_ids, chain_parents(len(token_ids)), match_len=best_len, source=SOURCE_NGRAM)
