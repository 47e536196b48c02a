"""One sequence's drafting session, without gRPC: its proposer settings, the
tokens committed so far, and drafting from them by suffix decoding or n-gram lookup."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from drafter_service.draft import Draft
from drafter_service.ngram import propose_ngram
from drafter_service.suffix_decoding import SuffixDecodingCache

METHOD_SUFFIX = "suffix"
METHOD_NGRAM = "ngram"
MAX_SPECULATIVE_TOKENS = 64
# Appending costs O(depth) per token, so a session may not ask for an unbounded tree.
MAX_TREE_DEPTH = 256


class CommittedLengthMismatch(ValueError):
    """The client's idea of the sequence length differs from the drafter's."""


@dataclass(frozen=True)
class ProposerParams:
    """Validated per-sequence settings (vLLM --speculative-config semantics)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_tree_depth: int = 24  # of the per-request tree
    use_tree_spec: bool = False

    def __post_init__(self):
        if self.method not in (METHOD_SUFFIX, METHOD_NGRAM):
            raise ValueError(f"method must be {METHOD_SUFFIX!r} or {METHOD_NGRAM!r}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        for name in ("max_spec_factor", "max_spec_offset", "min_token_prob"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.max_spec_factor < 0:
            raise ValueError("max_spec_factor must be >= 0")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError("min_token_prob must be in [0, 1]")
        if not 1 <= self.max_tree_depth <= MAX_TREE_DEPTH:
            raise ValueError(f"max_tree_depth must be between 1 and {MAX_TREE_DEPTH}")


class SequenceProposer:
    """Drafting state of one sequence; `request_key` must be unique among active sessions."""

    def __init__(self, cache: SuffixDecodingCache, request_key: str, params: ProposerParams, tenant: str = ""):
        self._cache = cache
        self._key = request_key
        self.params = params
        self.tenant = tenant
        self.tokens: list[int] = []  # prompt + committed output

    @property
    def committed_len(self) -> int:
        return len(self.tokens)

    def start(self, prompt_token_ids: Sequence[int]) -> None:
        self.tokens = list(prompt_token_ids)
        if self.params.method == METHOD_SUFFIX:
            self._cache.start_request(self._key, self.tokens, self.tenant, self.params.max_tree_depth)

    def commit(self, token_ids: Sequence[int], committed_len: int) -> None:
        """Appends committed tokens; `committed_len` is the length the caller expects afterwards."""
        if len(self.tokens) + len(token_ids) != committed_len:
            raise CommittedLengthMismatch(
                f"committed_len {committed_len} != {len(self.tokens)} known + {len(token_ids)} committed")
        self.tokens.extend(token_ids)
        if self.params.method == METHOD_SUFFIX:
            self._cache.add_active_response(self._key, token_ids)

    def propose(self) -> Draft:
        params = self.params
        if params.method == METHOD_NGRAM:
            return propose_ngram(self.tokens, params.num_speculative_tokens,
                                 params.prompt_lookup_min, params.prompt_lookup_max)
        return self._cache.speculate(self._key, self.tokens, params.num_speculative_tokens,
                                     params.max_spec_factor, params.max_spec_offset,
                                     params.min_token_prob, params.use_tree_spec)

    def end(self) -> None:
        """Ends the sequence: its own tree goes, its output stays in the global tree."""
        if self.params.method == METHOD_SUFFIX:
            self._cache.stop_request(self._key)
