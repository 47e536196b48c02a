"""One sequence's state: its tokens, KV cache, sampling generator and stop
conditions, plus the domain types of a prefill and a verify step."""

import enum
import math
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from verifier_service.errors import InvalidRequest
from verifier_service.sampling import SamplingParams


class FinishReason(enum.Enum):
    NONE = "none"
    STOP = "stop"  # EOS or a stop token id (included in the output)
    LENGTH = "length"  # max_new_tokens or the model's context length
    ABORT = "abort"  # the client went away


@dataclass(frozen=True)
class GenerationParams:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Proposal:
    """Sparse proposal distribution q of one draft token."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()  # empty or [-1, 0, 1, ...]: a chain
    proposals: tuple[Proposal, ...] = ()  # empty: deterministic draft
    committed_len: int = 0  # 0: not tagged

    def check(self, vocab_size: int) -> None:
        """Raises InvalidRequest unless this is a well-formed chain draft."""
        k = len(self.token_ids)
        if self.parents and len(self.parents) != k:
            raise InvalidRequest(f"draft has {k} tokens but {len(self.parents)} parents")
        if self.parents and list(self.parents) != list(range(-1, k - 1)):
            raise InvalidRequest("tree drafts are not supported yet; send a chain (parents empty or -1, 0, 1, ...)")
        _check_token_ids(self.token_ids, vocab_size, "draft token id")
        if self.proposals and len(self.proposals) != k:
            raise InvalidRequest(f"draft has {k} tokens but {len(self.proposals)} proposal distributions")
        for i, (token, proposal) in enumerate(zip(self.token_ids, self.proposals)):
            _check_proposal(i, token, proposal, vocab_size)


def _check_token_ids(token_ids, vocab_size: int, what: str) -> None:
    for token in token_ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"{what} {token} is outside the vocabulary [0, {vocab_size})")


def _check_proposal(i: int, token: int, proposal: Proposal, vocab_size: int) -> None:
    if len(proposal.token_ids) != len(proposal.probs):
        raise InvalidRequest(f"proposal {i} has {len(proposal.token_ids)} token ids but {len(proposal.probs)} probs")
    _check_token_ids(proposal.token_ids, vocab_size, f"proposal {i} token id")
    if not all(math.isfinite(p) and p >= 0 for p in proposal.probs):
        raise InvalidRequest(f"proposal {i} has a negative or non-finite probability")
    mass = sum(p for t, p in zip(proposal.token_ids, proposal.probs) if t == token)
    if not mass > 0:
        raise InvalidRequest(f"proposal {i} gives draft token {token} no probability, so it cannot have been sampled")


@dataclass(frozen=True)
class StepResult:
    token_ids: list[int]  # newly committed tokens
    num_accepted: int  # how many of them came from the draft
    committed_len: int  # prompt + output after this step
    finish_reason: FinishReason


class Sequence:
    """Invariant between steps: `cache` holds every token but the last one
    (None before prefill and once finished)."""

    def __init__(self, sequence_id: str, prompt: list[int], params: GenerationParams,
                 stop_token_ids: frozenset[int], max_len: int, generator: torch.Generator):
        self.sequence_id = sequence_id
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.max_len = max_len  # the model's context length
        self.generator = generator
        self.cache: DynamicCache | None = None
        self.finish_reason = FinishReason.NONE
        self.num_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.started = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not FinishReason.NONE

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def budget(self) -> int:
        """How many more tokens may be committed."""
        return min(self.params.max_new_tokens - self.num_generated, self.max_len - len(self.tokens))

    def commit(self, token_ids: list[int], num_accepted: int, num_draft_tokens: int = 0) -> StepResult:
        """Appends a step's tokens, cut after the first stop token or at the budget."""
        kept = token_ids[: self.budget()]
        for i, token in enumerate(kept):
            if token in self.stop_token_ids:
                kept = kept[: i + 1]
                self.finish_reason = FinishReason.STOP
                break
        self.tokens.extend(kept)
        if not self.finished and self.budget() <= 0:
            self.finish_reason = FinishReason.LENGTH
        num_accepted = min(num_accepted, len(kept))
        self.num_steps += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        return StepResult(kept, num_accepted, len(self.tokens), self.finish_reason)
