"""Drafting with a head inside the verifier. Each sequence keeps its own head
state: the head's KV over the committed (feature, next token) pairs, and the
pairs not yet fed. After a verify step the committed tokens arrive with the
target's features from that same pass, so a draft needs no extra target pass
and no network round trip. The draft steps' KV entries are rolled back after
drafting, so the head's cache always matches the committed sequence."""

from dataclasses import dataclass, field

import torch

from speclane.speculation import draft_value
from verifier_service.config import TreeShape
from verifier_service.heads.dynamic_tree import draft_tree
from verifier_service.heads.head import Head
from verifier_service.heads.layer import HeadKV


@dataclass(frozen=True)
class HeadDraft:
    token_ids: tuple[int, ...]
    # q of each draft token over the target vocabulary [k, vocab] when the
    # tokens were sampled; None for a deterministic draft (greedy, or a tree).
    proposals: torch.Tensor | None
    score: float  # expected accepted tokens: sum over i of the head's confidence in draft tokens 1..i
    parents: tuple[int, ...] = ()  # empty: a chain; else a tree (tree.py)


@dataclass
class HeadState:
    kv: HeadKV = field(default_factory=HeadKV)
    next_position: int = 0  # position of the next pair; pairs before it are in the KV already
    tokens: list[int] = field(default_factory=list)  # pending pairs
    features: list[torch.Tensor] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def add(self, first_position: int, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Pairs (features[i], next_tokens[i]) at first_position + i. A position
        already seen (a prefill repeated after preemption) is skipped."""
        for i, token in enumerate(next_tokens):
            position = first_position + i
            if position >= self.next_position:
                self.tokens.append(token)
                self.features.append(features[i])
                self.positions.append(position)
                self.next_position = position + 1


class HeadDrafter:
    """Drafts chains, or with a `tree` shape EAGLE-2's dynamic trees (dynamic_tree.py)."""

    def __init__(self, head: Head, tree: TreeShape | None = None):
        self.head = head
        self.tree = tree

    @torch.inference_mode()
    def draft(self, state: HeadState, k: int, temperature: float | None,
              generator: torch.Generator | None = None, token_cost: float = 0.0) -> HeadDraft:
        """Up to k tokens (a tree: k levels) after the last committed one. The
        pairs fed since the last draft go through the head first, in one pass;
        the draft steps' KV entries are rolled back after."""
        head = self.head
        if not state.tokens or k < 1:  # nothing new was committed: no draft
            return HeadDraft((), None, 0.0)
        device, dtype = head.embed_weight.device, head.embed_weight.dtype
        hidden = head(torch.tensor(state.tokens, device=device), torch.stack(state.features).to(dtype),
                      torch.tensor(state.positions, device=device), state.kv)[-1:]
        committed, position = len(state.kv), state.positions[-1]
        state.tokens, state.features, state.positions = [], [], []
        try:
            if self.tree is not None:
                tree = draft_tree(head, hidden, state.kv, position, k, self.tree, temperature, token_cost)
                return HeadDraft(tree.token_ids, None, tree.score, tree.parents)
            return self._chain(hidden, state.kv, position, k, temperature, generator, token_cost)
        finally:
            state.kv.truncate(committed)

    def _chain(self, hidden: torch.Tensor, kv: HeadKV, position: int, k: int, temperature: float | None,
               generator: torch.Generator | None, token_cost: float) -> HeadDraft:
        """Greedy, or sampled from q = softmax(logits / temperature) (then the
        proposals are returned).

        EAGLE-2's observation: the head's confidence tracks acceptance. The draft
        stops before a token whose chance of joining an accepted run, at most
        the head's top probability times the run so far, is worth less than the
        `token_cost` its verification adds (draft_value's tokens per cost). Once
        one token does not pay, no later one can. The choice is made before the
        token is drawn: a cut that looked at the drawn token would change which
        tokens a sampled draft proposes, and min(1, p/q) would no longer be exact."""
        head = self.head
        device = hidden.device
        vocab_map = head.draft_token_ids
        tokens: list[int] = []
        proposals: list[torch.Tensor] = []
        score, confidence = 0.0, 1.0
        for step in range(k):
            logits = head.logits(hidden)[0].float()
            q = torch.softmax(logits / temperature if temperature else logits, dim=-1)
            top = float(q.max())
            if confidence * top <= token_cost * draft_value(score, step, token_cost):
                break
            if temperature:
                choice = int(torch.multinomial(q, 1, generator=generator))
                proposals.append(q if vocab_map is None else _scatter(q, vocab_map, head.embed_weight.shape[0]))
            else:
                choice = int(torch.argmax(logits))
            confidence *= top
            score += confidence
            token = choice if vocab_map is None else int(vocab_map[choice])
            tokens.append(token)
            if step + 1 < k:
                position += 1
                hidden = head(torch.tensor([token], device=device), hidden, torch.tensor([position], device=device), kv)
        return HeadDraft(tuple(tokens), torch.stack(proposals) if proposals else None, score)


def _scatter(q: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.zeros(vocab_size, dtype=q.dtype, device=q.device).index_copy_(0, target_ids, q)
