"""Prefix affinity: which verifier last took each prompt prefix. A follow-up
turn's prompt extends the previous turn's (its prompt, the reply, the new
message), so sending it where that prefix went finds its KV in that
verifier's prefix cache instead of prefilling it again elsewhere."""

from collections import OrderedDict

BLOCK_TOKENS = 64  # prefixes are remembered at whole blocks, as a prefix cache holds them
MAX_PREFIXES = 65536  # about 4M prompt tokens' worth of blocks; the oldest are forgotten first


def block_prefixes(token_ids: list[int], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """A hash of each whole-block prefix of `token_ids`, shortest first."""
    hashes, running = [], 0
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        running = hash((running, tuple(token_ids[end - block_tokens: end])))
        hashes.append(running)
    return hashes


class PrefixAffinity:
    def __init__(self, max_prefixes: int = MAX_PREFIXES):
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> verifier index, least recent first
        self._max_prefixes = max_prefixes

    def lookup(self, prefixes: list[int]) -> tuple[int | None, int]:
        """The verifier that took the longest of these prefixes, and how many blocks it covers."""
        for length in range(len(prefixes), 0, -1):
            owner = self._owner.get(prefixes[length - 1])
            if owner is not None:
                return owner, length
        return None, 0

    def remember(self, prefixes: list[int], index: int) -> None:
        for prefix in prefixes:
            self._owner[prefix] = index
            self._owner.move_to_end(prefix)
        while len(self._owner) > self._max_prefixes:
            self._owner.popitem(last=False)

    def forget(self, index: int) -> None:
        """A verifier that went down lost its cache."""
        for prefix in [p for p, owner in self._owner.items() if owner == index]:
            del self._owner[prefix]
