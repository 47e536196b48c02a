"""One sequence's drafting session, without gRPC: its proposer settings, the
length committed so far, and drafting by suffix decoding or n-gram lookup on
the compiled engine."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from drafter_service.draft import Draft

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
    """Drafting state of one sequence on the engine (drafter_service.engine.DraftEngine)."""

    def __init__(self, engine, params: ProposerParams, tenant: str = ""):
        self._engine = engine
        self.params = params
        self.tenant = tenant
        self.committed_len = 0  # prompt + committed output
        self._seq_id: int | None = None
        self._uncommitted: list[int] = []  # committed here, not yet handed to the engine

    def start(self, prompt_token_ids: Sequence[int]) -> None:
        self._seq_id = self._engine.start(prompt_token_ids, self.params, self.tenant)
        self.committed_len = len(prompt_token_ids)

    def commit(self, token_ids: Sequence[int], committed_len: int) -> None:
        """Appends committed tokens; `committed_len` is the length the caller expects afterwards."""
        if self.committed_len + len(token_ids) != committed_len:
            raise CommittedLengthMismatch(
                f"committed_len {committed_len} != {self.committed_len} known + {len(token_ids)} committed")
        self.committed_len = committed_len
        self._uncommitted.extend(token_ids)

    async def propose(self) -> Draft:
        """Draft from prompt + everything committed (suffix decoding or n-gram lookup, per params)."""
        token_ids, self._uncommitted = self._uncommitted, []
        return await self._engine.step(self._seq_id, token_ids)

    def end(self) -> None:
        """Ends the sequence: its own tree goes, its output stays in the global tree."""
        if self._seq_id is not None:
            self._engine.end(self._seq_id)
            self._seq_id = None
