"""Arctic Inference's `SuffixDecodingCache` API on the compiled core.

`from drafter_service import SuffixDecodingCache` is a drop-in for
`arctic_inference.suffix_decoding.SuffixDecodingCache` (0.3.0): the same
constructor, methods, properties and draft fields, so code written for Arctic
runs unchanged. What differs is underneath: path drafts go on past the tree
depth, the GIL is released, memory is smaller and reused, and there is an
optional token budget (`max_cached_tokens`) and `memory_bytes()`.
"""

import itertools
from collections.abc import Hashable, KeysView, Sequence
from dataclasses import dataclass, field

from drafter_service import _core


@dataclass(slots=True)
class SuffixDecodingDraft:
    """A draft: `parents[i]` indexes token i's parent in `token_ids` (-1: the context);
    `score` is the sum of `probs`, the expected number of accepted tokens."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def _as_list(token_ids) -> list[int]:
    if type(token_ids) is list:
        return token_ids
    return token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)


class SuffixDecodingCache:
    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = -1, max_cached_tokens: int = 0):
        """`max_cached_requests` < 0: no limit, 0: no global tree; `max_cached_tokens` 0: no token budget."""
        if max_cached_requests > 0x7FFFFFFF:
            raise ValueError("max_cached_requests must be at most 2^31")
        self._core = _core.Cache(max_tree_depth, max_cached_requests, max_cached_tokens)
        self._max_tree_depth = max_tree_depth
        self._max_cached_requests = max_cached_requests
        self._active: dict[Hashable, int] = {}
        self._ids: dict[Hashable, int] = {}  # every request id the core may still hold
        self._req_ids: dict[int, Hashable] = {}
        self._numbers = itertools.count()

    @property
    def max_tree_depth(self) -> int:
        return self._max_tree_depth

    @property
    def max_cached_requests(self) -> int:
        return self._max_cached_requests

    @property
    def active_requests(self) -> KeysView:
        return self._active.keys()

    @property
    def cached_requests(self) -> KeysView:
        return {self._req_ids[number]: None for number in self._core.cached_requests()}.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        if req_id in self._active:
            raise ValueError(f"Request '{req_id}' is already active")
        number = self._ids.get(req_id)
        if number is None:
            self._forget_evicted()
            number = self._ids[req_id] = next(self._numbers)
            self._req_ids[number] = req_id
        self._core.start_request(number, _as_list(prompt_token_ids))  # replaces a cached response of req_id
        self._active[req_id] = number

    def stop_request(self, req_id: Hashable) -> None:
        if req_id not in self._active:
            raise ValueError(f"Request '{req_id}' is not active")
        self._core.stop_request(self._active.pop(req_id))

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        number = self._active.get(req_id)
        if number is None:
            raise ValueError(f"Request '{req_id}' is not active")
        _core.append_tokens(self._core, number, token_ids if type(token_ids) is list else _as_list(token_ids))

    def evict_cached_response(self, req_id: Hashable) -> None:
        number = self._ids.get(req_id)
        if number is None:
            raise ValueError(f"Request '{req_id}' is not cached")
        self._core.evict_cached_response(number)  # ValueError if it is not cached

    def speculate(self, req_id: Hashable, context: Sequence[int], max_spec_tokens: int | None = None,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                  use_tree_spec: bool = False) -> SuffixDecodingDraft:
        number = self._active.get(req_id)
        if number is None:
            raise ValueError(f"Request '{req_id}' is not active")
        if type(context) is not list:  # matches never use more than max_tree_depth tokens of it
            context = _as_list(context[-self._max_tree_depth:])
        return SuffixDecodingDraft(*_core.speculate_tail(
            self._core, number, context, self._max_tree_depth if max_spec_tokens is None else max_spec_tokens,
            max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec))

    def memory_bytes(self) -> int:
        """The real footprint of the trees, indexes and bookkeeping in the core."""
        return self._core.memory_bytes()

    def _forget_evicted(self) -> None:
        # The core evicts on its own (FIFO, budgets); drop ids it no longer holds once they pile up.
        if len(self._ids) < 2 * (len(self._active) + 1024):
            return
        held = set(self._core.cached_requests()) | set(self._active.values())
        self._ids = {req_id: number for req_id, number in self._ids.items() if number in held}
        self._req_ids = {number: req_id for req_id, number in self._ids.items()}
