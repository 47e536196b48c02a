"""Turning a draft tree into committed tokens without changing the output
distribution (Leviathan et al. 2023; Chen et al. 2023; SpecInfer's multi-draft
rejection sampling for trees). Pure functions over the target's logits or
probabilities: row 0 is the last committed token (it judges the root's
children), row i + 1 is draft node i (it judges node i's children, or gives
the bonus token when node i is a leaf). A chain is the one-child tree."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from protos.conventions import chain_parents
from verifier_service.sequence import TokenLogprob
from verifier_service.tree import children, is_chain


@dataclass(frozen=True)
class Verdict:
    token_ids: list[int]  # the accepted path's draft tokens, then the target's own token
    num_accepted: int
    path: list[int] = field(default_factory=list)  # accepted node indices, root to leaf

    @property
    def rows(self) -> list[int]:
        """The row that judged each of token_ids: row 0 the first, then each accepted node's own row."""
        return [0, *(node + 1 for node in self.path)]


def _children(draft: Sequence[int], parents) -> list[list[int]]:
    return children(chain_parents(len(draft)) if parents is None else parents)


def verify_greedy(draft: Sequence[int], targets: Sequence[int], parents=None) -> Verdict:
    """Walks down from the root while some child equals the target's argmax
    (`targets`: of each row, as one host copy for the pass's rows); emits the
    argmax where no child does (a correction, or a bonus at a leaf)."""
    kids = _children(draft, parents)
    path: list[int] = []
    row = 0
    while True:
        target = targets[row]
        match = next((child for child in kids[row] if draft[child] == target), None)
        if match is None:
            return Verdict([draft[i] for i in path] + [target], len(path), path)
        path.append(match)
        row = match + 1


def verify_sampled(
    draft: Sequence[int],
    probs: torch.Tensor,
    generator: torch.Generator,
    proposals: torch.Tensor | None = None,
    parents=None,
) -> Verdict:
    """Speculative sampling against target rows `probs` [k+1, vocab].

    At each node the children are tried in order against the current target
    p: child x with proposal q (row of `proposals`, or one-hot on x for a
    deterministic draft) is accepted with min(1, p(x)/q(x)); on rejection p
    becomes normalize(max(0, p - q)) and the next sibling is tried. When every
    child is rejected, the token is drawn from the remaining p. Each stage is
    an exact rejection-sampling step, so every emitted token is distributed
    as the target's (for one-hot q: accept with p(x), else draw from p without
    the rejected tokens).
    """
    if parents is None or is_chain(parents):
        return _verify_chain_sampled(draft, probs, generator, proposals)
    return _verify_tree_sampled(draft, probs, generator, proposals, parents)


def _verify_tree_sampled(draft: Sequence[int], probs: torch.Tensor, generator: torch.Generator,
                         proposals: torch.Tensor | None, parents) -> Verdict:
    """verify_sampled's rule on a tree with one copy to the host, not one wait for the device per node tried.
    What each node is tried against does not depend on chance, only on which earlier siblings were rejected
    (all of them, or it is not tried): so every node's acceptance probability, and every row's distribution
    once all its children are rejected, are computed up front, a loop over sibling ranks with each rank's
    nodes at once; then every node's uniform and every row's final token are drawn together, and the walk
    reads them. Each draw is used at most once along the walk, so the result is distributed as the
    one-at-a-time walk's."""
    k, device = len(draft), probs.device
    kids = _children(draft, parents)
    p = probs.clone()  # each row's distribution after its children tried so far were rejected
    accept = probs.new_zeros(k)
    tokens = torch.tensor(list(draft), dtype=torch.long, device=device)
    for rank in range(max(len(row_kids) for row_kids in kids)):
        nodes = [row_kids[rank] for row_kids in kids if len(row_kids) > rank]
        rows = torch.tensor([parents[n] + 1 for n in nodes], dtype=torch.long, device=device)
        nodes_t = torch.tensor(nodes, dtype=torch.long, device=device)
        current = p[rows]
        accept[nodes_t], residual = _tried(current, tokens[nodes_t], None if proposals is None else proposals[nodes_t])
        total = residual.sum(-1, keepdim=True)
        p[rows] = torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), current)
    accepted = torch.rand(k, generator=generator, device=device) < accept
    final = torch.multinomial(p, 1, generator=generator)[:, 0]
    decided = torch.cat([accepted.long(), final]).tolist()
    flags, finals = decided[:k], decided[k:]
    path: list[int] = []
    row = 0
    while (child := next((c for c in kids[row] if flags[c]), None)) is not None:
        path.append(child)
        row = child + 1
    return Verdict([draft[i] for i in path] + [finals[row]], len(path), path)


def _verify_chain_sampled(draft: Sequence[int], probs: torch.Tensor, generator: torch.Generator,
                          proposals: torch.Tensor | None) -> Verdict:
    """verify_sampled's rule on a chain with every decision made on the device and one copy to the host: every
    draft token's acceptance is drawn at once, the first rejection found, and the emitted token drawn from that
    row's residual, or from the bonus row when none is rejected. Independent uniforms make it the same
    distribution as the one-at-a-time walk."""
    k, device = len(draft), probs.device
    accept, residual = _tried(probs[:k], torch.tensor(list(draft), dtype=torch.long, device=device), proposals)
    rejected = torch.rand(k, generator=generator, device=device) >= accept
    # The first rejected position; the bonus row (k) where none is: argmax finds the first True.
    first = torch.cat([rejected, rejected.new_ones(1)]).int().argmax()
    candidates = torch.cat([residual, probs[k:k + 1]])
    final = candidates[first]
    final = torch.where(final.sum() > 0, final, probs[first])  # p == q up to rounding leaves no residual
    token = torch.multinomial(final, 1, generator=generator)[0]
    accepted, emitted = torch.stack([first, token]).tolist()
    return Verdict([*draft[:accepted], emitted], accepted, list(range(accepted)))


def _tried(p: torch.Tensor, tokens: torch.Tensor, proposals: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows p [m, vocab] each trying a token (proposed by the row of `proposals`, or deterministically where
    None): its chance of acceptance, min(1, p/q) left to the draw, and the row's residual after a rejection,
    not normalised (p without the token, or max(0, p - q))."""
    hit = p.gather(1, tokens[:, None])[:, 0]
    if proposals is None:
        return hit, p.scatter(1, tokens[:, None], 0.0)
    return hit / proposals.gather(1, tokens[:, None])[:, 0], (p - proposals).clamp_min(0.0)


def dense_proposals(
    proposals: Sequence[tuple[Sequence[int], Sequence[float]]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[k, vocab] normalised q rows from sparse (token_ids, probs) pairs
    (already validated: ids in range, probs finite, non-negative, some mass)."""
    dense = torch.zeros(len(proposals), vocab_size, dtype=torch.float32, device=device)
    for row, (token_ids, token_probs) in enumerate(proposals):
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
        dense[row].index_add_(0, ids, torch.tensor(list(token_probs), dtype=torch.float32, device=device))
    return dense / dense.sum(dim=-1, keepdim=True)


def committed_logprobs(logits: torch.Tensor, verdict: Verdict, num_top: int) -> list[TokenLogprob]:
    """vLLM's raw logprobs: each committed token's log-probability under the
    log-softmax of the raw logits row that judged it (no temperature, controls
    or cuts), with that row's `num_top` most likely tokens."""
    device = logits.device
    logprobs = torch.log_softmax(logits[torch.tensor(verdict.rows, device=device)].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(verdict.token_ids, device=device)[:, None])[:, 0]
    top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
    return [TokenLogprob(logprob, tuple(ids), tuple(values))
            for logprob, ids, values in zip(chosen.tolist(), top.indices.tolist(), top.values.tolist())]
