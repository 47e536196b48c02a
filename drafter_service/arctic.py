"""Arctic Inference's `SuffixDecodingCache` API on the compiled core.

`from drafter_service import SuffixDecodingCache` is a drop-in for
`arctic_inference.suffix_decoding.SuffixDecodingCache` (0.3.0): the same
constructor, methods, properties and draft fields, so code written for Arctic
runs unchanged. What differs is underneath: path drafts go on past the tree
depth, the GIL is released, memory is smaller and reused, and there is an
optional token budget (`max_cached_tokens`) and `memory_bytes()`.
"""

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


class SuffixDecodingCache(_core.ArcticCache):
    """Per-request suffix trees over prompt + output and one global tree over
    past responses. `max_cached_requests` < 0: no limit, 0: no global tree;
    `max_cached_tokens` 0: no token budget. Request ids may be any hashable.

    Methods (in the compiled base): `start_request(req_id, prompt_token_ids)`,
    `add_active_response(req_id, token_ids)`, `stop_request(req_id)`,
    `evict_cached_response(req_id)`, `speculate(req_id, context,
    max_spec_tokens=None, max_spec_factor=1.0, max_spec_offset=0.0,
    min_token_prob=0.1, use_tree_spec=False) -> SuffixDecodingDraft`,
    `memory_bytes()`; properties `active_requests`, `cached_requests`,
    `max_tree_depth`, `max_cached_requests`.
    """

    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = -1, max_cached_tokens: int = 0):
        if max_cached_requests > 0x7FFFFFFF:
            raise ValueError("max_cached_requests must be at most 2^31")
        super().__init__(max_tree_depth, max_cached_requests, max_cached_tokens, SuffixDecodingDraft)
