"""One sequence's state: its tokens, KV cache, sampling generator and stop
conditions, plus the domain types of a prefill and a verify step."""

import enum
import math
import time
from dataclasses import dataclass, field

import torch

from protos.conventions import chain_parents
from speclane.speculation import MAX_SPECULATIVE_TOKENS
from verifier_service.block_manager import BlockTable
from verifier_service.errors import InvalidRequest
from verifier_service.grammar import GrammarMatcher
from verifier_service.heads.drafting import HeadDraft, HeadState
from verifier_service.logits_processing import LogitsProcessor
from verifier_service.sampling import SamplingParams
from verifier_service.tree import check_parents, depths, keep_nodes


class FinishReason(enum.Enum):
    NONE = "none"
    STOP = "stop"  # EOS or a stop token id (included in the output)
    LENGTH = "length"  # max_new_tokens or the model's context length
    ABORT = "abort"  # the client went away


MAX_LOGPROBS = 20  # alternatives per token, vLLM's default max_logprobs


@dataclass(frozen=True)
class GenerationParams:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: not reported; else how many most likely alternatives with each token
    grammar: str | None = None  # structured output, llguidance's Lark syntax
    num_head_draft_tokens: int = 0  # > 0: the verifier's head drafts this many tokens after each step
    head_draft_on_demand: bool = False  # the head drafts only for a step that verifies its draft, at its start
    cache_salt: str = ""  # prefix-cache blocks are shared only among sequences with the same salt (the tenant)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.sampling.min_tokens > self.max_new_tokens:
            raise InvalidRequest(f"min_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                                 f"got {self.sampling.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0 <= self.num_head_draft_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequest(f"num_head_draft_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                                 f"got {self.num_head_draft_tokens}")


@dataclass(frozen=True)
class Proposal:
    """Sparse proposal distribution q of one draft token."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()  # empty: a chain; else a tree (see tree.py)
    proposals: tuple[Proposal, ...] = ()  # empty: deterministic draft
    committed_len: int = 0  # 0: not tagged
    from_head: bool = False  # verify the verifier head's own draft instead (Verify.use_head_draft)
    # Dense q rows [k, vocab] of a draft sampled inside the verifier (a head's): never crosses the wire.
    proposal_probs: torch.Tensor | None = field(default=None, compare=False)

    @property
    def tree_parents(self) -> tuple[int, ...]:
        return self.parents or chain_parents(len(self.token_ids))

    def check(self, vocab_size: int) -> None:
        """Raises InvalidRequest unless this is a well-formed chain or tree draft."""
        k = len(self.token_ids)
        if self.parents and (problem := check_parents(self.parents, k)):
            raise InvalidRequest(problem)
        check_token_ids(self.token_ids, vocab_size, "draft token id")
        if self.proposals and len(self.proposals) != k:
            raise InvalidRequest(f"draft has {k} tokens but {len(self.proposals)} proposal distributions")
        for i, (token, proposal) in enumerate(zip(self.token_ids, self.proposals)):
            _check_proposal(i, token, proposal, vocab_size)

    def trimmed(self, max_nodes: int, max_depth: int) -> "Draft":
        """The sub-tree of the first `max_nodes` nodes no deeper than `max_depth`
        (still a tree: parents precede children and are never deeper)."""
        parents = self.tree_parents
        keep = [i for i, depth in enumerate(depths(parents)[:max(max_nodes, 0)]) if depth <= max_depth]
        if len(keep) == len(parents):
            return self
        return Draft(
            token_ids=tuple(self.token_ids[i] for i in keep),
            parents=keep_nodes(parents, keep),
            proposals=tuple(self.proposals[i] for i in keep) if self.proposals else (),
            committed_len=self.committed_len,
            proposal_probs=None if self.proposal_probs is None else self.proposal_probs[keep],
        )


def check_token_ids(token_ids, vocab_size: int, what: str) -> None:
    for token in token_ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"{what} {token} is outside the vocabulary [0, {vocab_size})")


def _check_proposal(i: int, token: int, proposal: Proposal, vocab_size: int) -> None:
    if len(proposal.token_ids) != len(proposal.probs):
        raise InvalidRequest(f"proposal {i} has {len(proposal.token_ids)} token ids but {len(proposal.probs)} probs")
    check_token_ids(proposal.token_ids, vocab_size, f"proposal {i} token id")
    if not all(math.isfinite(p) and p >= 0 for p in proposal.probs):
        raise InvalidRequest(f"proposal {i} has a negative or non-finite probability")
    mass = sum(p for t, p in zip(proposal.token_ids, proposal.probs) if t == token)
    if not mass > 0:
        raise InvalidRequest(f"proposal {i} gives draft token {token} no probability, so it cannot have been sampled")


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the model's raw distribution
    at its position, and the most likely tokens there, most likely first."""

    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class StepResult:
    token_ids: list[int]  # newly committed tokens
    num_accepted: int  # how many of them came from the draft
    committed_len: int  # prompt + output after this step
    finish_reason: FinishReason
    num_draft_tokens: int = 0  # draft tokens verified in this step
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry, when requested
    head_draft: tuple[int, ...] = ()  # the head's draft for the next step (kept in the sequence with its q)
    head_draft_parents: tuple[int, ...] = ()  # empty: a chain
    head_draft_score: float = 0.0
    forward_seconds: float = 0.0  # the pass that produced it (shared with its batch)
    head_draft_seconds: float = 0.0  # the head's drafting for this step (SessionResponse.head_draft_seconds)
    num_running: int = 0  # sequences admitted when its pass ran (SessionResponse.num_running)


class Sequence:
    """Between steps its KV blocks hold `num_cached` tokens: every token but the
    last one once prefilled, fewer while a prefill is chunked, none before
    admission or after preemption (the tokens stay, so it is prefilled again)."""

    def __init__(self, sequence_id: str, prompt: list[int], params: GenerationParams,
                 stop_token_ids: frozenset[int], max_len: int, generator: torch.Generator,
                 logits_processor: LogitsProcessor | None = None, grammar: GrammarMatcher | None = None):
        self.sequence_id = sequence_id
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.max_len = max_len  # the model's context length
        self.generator = generator
        self.logits_processor = logits_processor  # None: the request sets no logit control
        self.grammar = grammar  # None: free-form output
        self.head: HeadState | None = None  # set when the verifier's head drafts for this sequence
        self.head_draft: HeadDraft | None = None  # its draft continuing the committed tokens
        self.head_draft_seconds = 0.0  # the time the head took for it, until reported with a step
        self.blocks: BlockTable | None = None  # its KV blocks while admitted
        self.num_cached = 0
        # Prompt tokens the prefix cache held at its first admission (vLLM's num_cached_tokens).
        self.num_cached_prompt_tokens = 0
        self.state_slot: int | None = None  # models with linear attention: its state's slot while admitted
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

    def max_draft_depth(self) -> int:
        """How deep a draft can still pay off: a step commits the accepted tokens
        plus one of the target's own, so a deeper node could never add a token."""
        return self.budget() - 1

    def own_draft(self) -> Draft:
        """The head's draft for the next step, with its q (empty without a head)."""
        draft = self.head_draft
        if draft is None:
            return Draft()
        return Draft(token_ids=draft.token_ids, parents=draft.parents, proposal_probs=draft.proposals,
                     committed_len=len(self.tokens))

    def commit(self, token_ids: list[int], num_accepted: int, num_draft_tokens: int = 0,
               logprobs: list[TokenLogprob] | None = None) -> StepResult:
        """Appends a step's tokens, cut after the first stop token or at the budget;
        `logprobs`, when given, are the tokens' and are cut with them."""
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
        return StepResult(kept, num_accepted, len(self.tokens), self.finish_reason, num_draft_tokens,
                          logprobs[: len(kept)] if logprobs else [])
