"""Prompt lookup over one sequence's own tokens: the verifier's draft for a step
whose next-round offers all missed (NextRound.lookup_tokens), so it can start
that step at once instead of waiting a round trip for the client's draft.

It drafts as a per-request suffix tree does at its default budget: find the
longest suffix of the sequence that occurred before, and propose what followed
its latest occurrence, at most as many tokens as matched. Plain Python: the
list searches run in C, and a few tensor operations would cost more (about a
millisecond) on the thread that answers the clients."""

# Matches longer than this gain nothing: a draft is at most this long anyway.
MAX_MATCH = 64


def lookup_draft(tokens: list[int], max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens continuing `tokens` as its longest earlier-seen suffix continued before."""
    if max_tokens <= 0 or len(tokens) < 2:
        return []
    last = len(tokens) - 1
    backwards = tokens[::-1]  # backwards[i] is tokens[last - i]: the latest occurrences are found first
    best_len, best_start = 0, 0
    i = 0
    while best_len < MAX_MATCH:
        try:
            i = backwards.index(backwards[0], i + 1)
        except ValueError:
            break
        matched = 1  # tokens[last - i] is the last token; extend the match backwards
        while matched < MAX_MATCH and i + matched <= last and backwards[i + matched] == backwards[matched]:
            matched += 1
        if matched > best_len:  # strictly longer: among equal matches the latest, found first, stays
            best_len, best_start = matched, last - i + 1
    return tokens[best_start:best_start + min(max_tokens, best_len)]
