"""Turning a chain draft into committed tokens without changing the output
distribution (Leviathan et al. 2023; Chen et al. 2023). Pure functions over
the target's logits or probabilities for the k+1 positions [last, d1..dk]:
row i judges draft token i, row k gives the bonus token."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifier_service.sampling import sample


@dataclass(frozen=True)
class Verdict:
    token_ids: list[int]  # the accepted draft tokens, then the target's own token
    num_accepted: int


def verify_greedy(draft: Sequence[int], logits: torch.Tensor) -> Verdict:
    """Accepts while the draft equals the argmax; emits the argmax at the first
    mismatch, or a bonus argmax when everything matched."""
    targets = torch.argmax(logits, dim=-1).tolist()
    for i, token in enumerate(draft):
        if token != targets[i]:
            return Verdict([*draft[:i], targets[i]], i)
    return Verdict([*draft, targets[len(draft)]], len(draft))


def verify_sampled(
    draft: Sequence[int],
    probs: torch.Tensor,
    generator: torch.Generator,
    proposals: torch.Tensor | None = None,
) -> Verdict:
    """Speculative sampling against target rows `probs` [k+1, vocab].

    With `proposals` q [k, vocab] (the distributions the draft was sampled
    from; q(x) > 0 for each draft token x): accept x with min(1, p(x)/q(x)),
    on rejection draw from normalize(max(0, p - q)). Without, the draft is
    deterministic (one-hot q): accept with p(x), on rejection draw from p with
    x removed. Either way every emitted token is distributed exactly as p.
    """
    for i, token in enumerate(draft):
        p = probs[i]
        accept = p[token] if proposals is None else p[token] / proposals[i, token]
        if torch.rand((), generator=generator, device=p.device) < accept:
            continue
        if proposals is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - proposals[i]).clamp_min(0.0)
        if not residual.sum() > 0:
            residual = p  # only reachable when p == q up to rounding
        return Verdict([*draft[:i], sample(residual, generator)], i)
    return Verdict([*draft, sample(probs[len(draft)], generator)], len(draft))


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
