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
from verifier_service.heads.dynamic_tree import draft_trees
from verifier_service.heads.head import Head
from verifier_service.heads.layer import HeadKV, KVBatch
from verifier_service.sampling import draw, draw_uniforms, greedy_choices


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


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's draft: up to k tokens (a tree: k levels) after its last committed one."""

    state: HeadState
    k: int
    temperature: float | None
    generator: torch.Generator | None = None


@dataclass
class _Chain:
    tokens: list[int] = field(default_factory=list)
    proposals: list[torch.Tensor] = field(default_factory=list)
    score: float = 0.0
    confidence: float = 1.0  # the head's probability of the whole chain so far


class HeadDrafter:
    """Drafts chains, or with a `tree` shape EAGLE-2's dynamic trees (dynamic_tree.py)."""

    def __init__(self, head: Head, tree: TreeShape | None = None):
        self.head = head
        self.tree = tree

    def draft(self, state: HeadState, k: int, temperature: float | None,
              generator: torch.Generator | None = None, token_cost: float = 0.0) -> HeadDraft:
        return self.draft_many([DraftRequest(state, k, temperature, generator)], token_cost)[0]

    @torch.inference_mode()
    def draft_many(self, requests: list[DraftRequest], token_cost: float = 0.0) -> list[HeadDraft]:
        """Each request's draft, its sequence's new pairs fed through the head
        first. The sequences go through every head step together: a step's
        rows read the head's weights once, however many sequences there are
        (vLLM drafts a batch the same way). The draft steps' KV entries are
        rolled back after."""
        drafts = [HeadDraft((), None, 0.0)] * len(requests)
        live = [i for i, r in enumerate(requests) if r.state.tokens and r.k >= 1]  # else nothing new: no draft
        if not live:
            return drafts
        states = [requests[i].state for i in live]
        positions = [state.positions[-1] for state in states]
        hidden = self._feed(states)
        committed = [len(state.kv) for state in states]
        try:
            if self.tree is None:
                made = self._chains([requests[i] for i in live], hidden, positions, token_cost)
            else:
                made = self._trees([requests[i] for i in live], hidden, positions, token_cost)
        finally:
            for state, length in zip(states, committed):
                state.kv.truncate(length)
        for i, draft in zip(live, made):
            drafts[i] = draft
        return drafts

    def _feed(self, states: list[HeadState]) -> torch.Tensor:
        """The pairs fed since each sequence's last draft, through the head in
        one pass; the head's output at each sequence's last pair [len(states), H]."""
        head = self.head
        device, dtype = head.embed_weight.device, head.embed_weight.dtype
        sizes = [len(state.tokens) for state in states]
        hidden = head(torch.tensor([t for state in states for t in state.tokens], device=device),
                      torch.stack([f for state in states for f in state.features]).to(dtype),
                      torch.tensor([p for state in states for p in state.positions], device=device),
                      KVBatch([state.kv for state in states], sizes))
        for state in states:
            state.tokens, state.features, state.positions = [], [], []
        return hidden[torch.tensor(sizes).cumsum(0) - 1]

    def _trees(self, requests: list[DraftRequest], hidden: torch.Tensor, positions: list[int],
               token_cost: float) -> list[HeadDraft]:
        trees = draft_trees(self.head, hidden, [r.state.kv for r in requests], positions, [r.k for r in requests],
                            [r.temperature for r in requests], self.tree, token_cost)
        return [HeadDraft(tree.token_ids, None, tree.score, tree.parents) for tree in trees]

    def _chains(self, requests: list[DraftRequest], hidden: torch.Tensor, positions: list[int],
                token_cost: float) -> list[HeadDraft]:
        """Greedy, or sampled from q = softmax(logits / temperature) (then the
        proposals are returned). Each step's rows are the chains still growing,
        and every row's q, top probability and token are computed together and
        read with one copy to the host: on an accelerator each copy waits for
        the device, so a step waits once, not twice per sequence.

        EAGLE-2's observation: the head's confidence tracks acceptance. A chain
        stops before a token whose chance of joining an accepted run, at most
        the head's top probability times the run so far, is worth less than the
        `token_cost` its verification adds (draft_value's tokens per cost). Once
        one token does not pay, no later one can. The choice depends on the top
        probability alone, not on the token drawn (which a stopping row draws
        and drops): a cut that looked at the drawn token would change which
        tokens a sampled draft proposes, and min(1, p/q) would no longer be exact."""
        head = self.head
        device = hidden.device
        vocab_map, vocab_size = head.draft_token_ids, head.embed_weight.shape[0]
        chains = [_Chain() for _ in requests]
        growing, positions = list(range(len(requests))), list(positions)
        for step in range(max(r.k for r in requests)):
            growing_requests = [requests[i] for i in growing]
            tops, tokens, proposals = _draft_step(head.logits(hidden).float(), growing_requests, vocab_map,
                                                     vocab_size)
            rows, going = [], []  # the rows, and the chains, that take another step
            for row, (i, top, token) in enumerate(zip(growing, tops, tokens)):
                request, chain = requests[i], chains[i]
                if chain.confidence * top <= token_cost * draft_value(chain.score, step, token_cost):
                    continue
                if request.temperature:
                    chain.proposals.append(proposals[row])
                chain.confidence *= top
                chain.score += chain.confidence
                chain.tokens.append(token)
                if step + 1 < request.k:
                    rows.append(row)
                    going.append(i)
            if not going:
                break
            growing = going
            for i in growing:
                positions[i] += 1
            hidden = head(torch.tensor([chains[i].tokens[-1] for i in growing], device=device), hidden[rows],
                          torch.tensor([positions[i] for i in growing], device=device),
                          KVBatch([requests[i].state.kv for i in growing], [1] * len(growing)))
        return [HeadDraft(tuple(c.tokens), torch.stack(c.proposals) if c.proposals else None, c.score)
                for c in chains]


def _draft_step(logits: torch.Tensor, requests: list[DraftRequest], vocab_map: torch.Tensor | None,
                vocab_size: int) -> tuple[list[float], list[int], torch.Tensor | None]:
    """One draft step of chains, a row of `logits` [rows, draft vocab] each, with q the softmax at each request's
    temperature (at 1 for greedy): each row's top probability and token in the target's vocabulary (the argmax
    for greedy, else drawn from q with a uniform from the request's generator), read with one copy, and every
    row's q over the target's vocabulary where some row samples (else None)."""
    device = logits.device
    temperatures = torch.tensor([r.temperature or 1.0 for r in requests], dtype=logits.dtype, device=device)
    q = torch.softmax(logits / temperatures[:, None], dim=-1)
    tokens = greedy_choices(logits)
    sampled = [row for row, r in enumerate(requests) if r.temperature]
    proposals = None
    if sampled:
        uniforms = draw_uniforms([1] * len(sampled), [requests[row].generator for row in sampled], device)
        at = torch.tensor(sampled, device=device)
        tokens = tokens.index_copy(0, at, draw(q.index_select(0, at), uniforms))
        proposals = q if vocab_map is None else q.new_zeros(len(q), vocab_size).index_copy_(1, vocab_map, q)
    if vocab_map is not None:
        tokens = vocab_map[tokens]
    # Token ids are exact in fp32 (below 2**24), so the tops and tokens travel in one copy.
    tops, ids = torch.stack([q.amax(dim=-1), tokens.to(q.dtype)]).tolist()
    return tops, [int(token) for token in ids], proposals
