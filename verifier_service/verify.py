"""Turning a draft tree into committed tokens without changing the output
distribution (Leviathan et al. 2023; Chen et al. 2023; SpecInfer's multi-draft
rejection sampling for trees). Pure functions over the target's logits or
probabilities: row 0 is the last committed token (it judges the root's
children), row i + 1 is draft node i (it judges node i's children, or gives
the bonus token when node i is a leaf). A chain is the one-child tree."""

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from protos.conventions import chain_parents
from verifier_service.sampling import draw, draw_uniforms
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


@dataclass(frozen=True)
class SampledStep:
    """One sequence's draft in a pass, judged by sampling: rows first_row .. first_row + k of the pass's target
    probabilities judge it (row 0 its last committed token, row i + 1 draft node i)."""

    draft: Sequence[int]
    first_row: int
    generator: torch.Generator
    proposals: torch.Tensor | None = None  # [k, vocab] q rows of a sampled draft; None: deterministic
    parents: Sequence[int] | None = None  # None (or a chain's): a chain

    @functools.cached_property
    def is_chain(self) -> bool:
        """A chain is decided with the pass's other chains (_chains_decisions), a tree with its trees."""
        return self.parents is None or is_chain(self.parents)


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
    verdict = verify_sampled_batch(probs, [SampledStep(draft, 0, generator, proposals, parents)])[0]
    if isinstance(verdict, RuntimeError):
        raise verdict
    return verdict


def verify_sampled_batch(probs: torch.Tensor, steps: Sequence[SampledStep]) -> list[Verdict | RuntimeError]:
    """verify_sampled for several steps whose rows are in `probs`, with one copy to the host for them all."""
    return sampled_verdicts(steps, iter(sampled_decisions(probs, steps).tolist()))


def sampled_decisions(probs: torch.Tensor, steps: Sequence[SampledStep]) -> torch.Tensor:
    """What decides each step's verdict, left on the device (1-D, int64), so that the sampled steps of a pass
    are read with one copy to the host rather than a wait for the device per sequence. The chains (the drafters'
    and heads' drafts, with or without proposals, and plain decodes) are decided together in a few operations,
    then the trees together in a few a sibling rank. The uniforms come from the steps' generators
    (sampling.draw_uniforms), so a seeded request's outcome does not depend on the rest of the pass."""
    chains, trees = _partition(steps)
    parts = [_chains_decisions(probs, [steps[i] for i in chains]).flatten()] if chains else []
    if trees:
        parts.append(_trees_decisions(probs, [steps[i] for i in trees]))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=probs.device)


def sampled_verdicts(steps: Sequence[SampledStep], decided: Iterator[int]) -> list[Verdict | RuntimeError]:
    """The steps' verdicts from their decisions on the host (sampled_decisions', consumed from `decided`); a
    step whose row has no mass to draw from gets the error in place of its verdict."""
    chains, trees = _partition(steps)
    verdicts: list[Verdict | RuntimeError | None] = [None] * len(steps)
    for i in chains:
        verdicts[i] = _unless_unusable(_chain_verdict, steps[i].draft, *itertools.islice(decided, 3))
    num_nodes = sum(len(steps[i].draft) for i in trees)
    num_rows = num_nodes + len(trees)
    tree_decisions = list(itertools.islice(decided, num_nodes + 2 * num_rows))
    flags, finals, usable = (tree_decisions[:num_nodes], tree_decisions[num_nodes: num_nodes + num_rows],
                             tree_decisions[num_nodes + num_rows:])
    node = row = 0
    for i in trees:
        step, k = steps[i], len(steps[i].draft)
        verdicts[i] = _unless_unusable(_tree_verdict, step.draft, step.parents, flags[node: node + k],
                                       finals[row: row + k + 1], usable[row: row + k + 1])
        node, row = node + k, row + k + 1
    return verdicts


def _unless_unusable(verdict, *args) -> Verdict | RuntimeError:
    try:
        return verdict(*args)
    except RuntimeError as error:
        return error


def _partition(steps: Sequence[SampledStep]) -> tuple[list[int], list[int]]:
    """The chains, then the trees: the order of their decisions."""
    return ([i for i, step in enumerate(steps) if step.is_chain],
            [i for i, step in enumerate(steps) if not step.is_chain])


def _usable(probs: torch.Tensor) -> torch.Tensor:
    """1 for each row [m, vocab] with some finite mass to draw from, else 0 (its step fails, as multinomial
    would refuse it)."""
    total = probs.sum(-1)
    return (torch.isfinite(total) & (total > 0)).long()


def _chains_decisions(probs: torch.Tensor, steps: list[SampledStep]) -> torch.Tensor:
    """[steps, 3]: for chains, the number of draft tokens accepted, the token emitted after them and whether its
    row could be drawn from. Draft token j of a chain is accepted with min(1, p_j(x_j) / q_j(x_j)), q_j being
    its proposal row, or one-hot on x_j for a deterministic draft (then p_j(x_j)); at the first rejection the
    token is drawn from the residual, max(0, p_j - q_j) (p_j without x_j for a deterministic draft; p_j itself
    where p_j == q_j up to rounding leaves none), else from the bonus row. Plain indexing, comparisons and
    argmax, which every device's torch has (no scatter-reduce)."""
    device = probs.device
    counts = [len(step.draft) for step in steps]
    offsets = list(itertools.accumulate(counts, initial=0))
    num_tokens, widest = offsets.pop(), max(counts)
    # Chain i's uniforms come k_i for its draft tokens, then one for the token it emits: its draft token j's is
    # at offsets[i] + i + j, its last at offsets[i] + i + k_i.
    layout = torch.tensor([[step.first_row + j for step in steps for j in range(len(step.draft))],
                           [token for step in steps for token in step.draft],
                           [offset + i + j for i, (offset, k) in enumerate(zip(offsets, counts)) for j in range(k)]],
                          dtype=torch.long, device=device)
    rows, tokens, accepting = layout
    per_chain = torch.tensor([counts, [step.first_row for step in steps], offsets,
                              [offset + i + k for i, (offset, k) in enumerate(zip(offsets, counts))]],
                             dtype=torch.long, device=device)
    k, first_rows, token_offsets, emitting = per_chain
    # Each chain's draft tokens in a row, padded to the widest and one more with an index read as a rejection.
    grid = torch.tensor([[offset + j if j < count else num_tokens for j in range(widest + 1)]
                         for offset, count in zip(offsets, counts)], dtype=torch.long, device=device)
    uniforms = draw_uniforms([n + 1 for n in counts], [step.generator for step in steps], device)
    proposing = [i for i, step in enumerate(steps) if step.proposals is not None and counts[i]]
    chance = probs[rows, tokens]
    if proposing:
        # The proposal rows of the chains that have them, and where their draft tokens are among all the chains'.
        proposals = torch.cat([steps[i].proposals for i in proposing])
        proposed = torch.tensor([offsets[i] + j for i in proposing for j in range(counts[i])], device=device)
        chance = chance.index_copy(0, proposed, chance[proposed] / proposals[torch.arange(len(proposed),
                                                                                          device=device),
                                                                             tokens[proposed]])
    rejected = torch.cat([uniforms[accepting] >= chance, torch.ones(1, dtype=torch.bool, device=device)])
    first = rejected[grid].int().argmax(dim=1)  # argmax finds the first True: k_i where none is rejected
    final = probs.index_select(0, first_rows + first)  # a rejection's row, or the bonus row (first == k)
    if num_tokens:
        at = (token_offsets + first).clamp(max=num_tokens - 1)
        residual = final.scatter(1, tokens[at][:, None], 0.0)
        if proposing:
            chains = torch.tensor(proposing, device=device)
            starts = torch.tensor(list(itertools.accumulate((counts[i] for i in proposing), initial=0))[:-1],
                                  device=device)
            tried = proposals.index_select(0, starts + first[chains].clamp(max=k[chains] - 1))
            residual = residual.index_copy(0, chains, (final.index_select(0, chains) - tried).clamp_min(0.0))
        keep = (first < k)[:, None] & (residual.sum(-1, keepdim=True) > 0)
        final = torch.where(keep, residual, final)
    emitted = draw(final, uniforms[emitting])
    return torch.stack([first, emitted, _usable(final)], dim=1)


def _trees_decisions(probs: torch.Tensor, steps: list[SampledStep]) -> torch.Tensor:
    """verify_sampled's rule on trees, decided on the device: every node's acceptance, then every row's token,
    then whether each row could be drawn from (1-D: K node flags, then R = K + len(steps) row tokens and R row
    flags; tree after tree in each part). What a node is tried against does not depend on chance, only on which
    earlier siblings were rejected (all of them, or it is not tried): so every node's acceptance probability,
    and every row's distribution once all its children are rejected, are computed up front, a loop over sibling
    ranks with that rank's nodes of every tree at once; then every node's uniform and every row's final token
    are drawn together, and the walk (_tree_verdict) reads them. Each draw is used at most once along the walk,
    so the result is distributed as the one-at-a-time walk's."""
    device = probs.device
    sizes = [len(step.draft) for step in steps]
    nodes_before = list(itertools.accumulate(sizes, initial=0))  # tree t's node i is node nodes_before[t] + i
    num_nodes = nodes_before.pop()
    # A tree's uniforms come k for its nodes, then k + 1 for its rows.
    draws_before = list(itertools.accumulate((2 * k + 1 for k in sizes), initial=0))
    proposal_rows: dict[int, int] = {}  # a node of a tree with proposals: its row among those trees' q rows
    for t, step in enumerate(steps):
        if step.proposals is not None:
            first = len(proposal_rows)
            proposal_rows.update((nodes_before[t] + i, first + i) for i in range(sizes[t]))
    ranks: list[tuple[list[int], list[int]]] = []  # each sibling rank's (rows, nodes), of every tree
    # Tree t's row r is row nodes_before[t] + t + r.
    for t, step in enumerate(steps):
        for row, kids in enumerate(_children(step.draft, step.parents)):
            for rank, node in enumerate(kids):
                if rank == len(ranks):
                    ranks.append(([], []))
                ranks[rank][0].append(nodes_before[t] + t + row)
                ranks[rank][1].append(nodes_before[t] + node)
    # Everything the device needs in one copy: the trees' rows of probs, the order that takes each node's and
    # each row's uniform from the generators' draws, the draft tokens, then each rank's rows, nodes, and the
    # positions and q rows of its proposed nodes.
    parts = [[step.first_row + r for step, k in zip(steps, sizes) for r in range(k + 1)],
             [first + i for first, k in zip(draws_before, sizes) for i in range(k)]
             + [first + k + r for first, k in zip(draws_before, sizes) for r in range(k + 1)],
             [token for step in steps for token in step.draft]]
    proposed = [[i for i, node in enumerate(nodes) if node in proposal_rows] for _, nodes in ranks]
    for (rows, nodes), at in zip(ranks, proposed):
        parts += [rows, nodes, at, [proposal_rows[nodes[i]] for i in at]]
    layout = torch.tensor([i for part in parts for i in part], dtype=torch.long, device=device)
    rows_of, draw_order, tokens, *rank_parts = layout.split([len(part) for part in parts])
    # Each row's distribution after its children tried so far were rejected (index_select copies whole rows,
    # where a CPU's advanced indexing goes element by element: 1.2 ms more for a tree of 16 nodes).
    p = probs.index_select(0, rows_of)
    accept = p.new_zeros(num_nodes)
    proposals = torch.cat([step.proposals for step in steps if step.proposals is not None]) if proposal_rows else None
    for rank, any_proposed in enumerate(proposed):
        rows, nodes, at, q_rows = rank_parts[4 * rank: 4 * rank + 4]
        current = p.index_select(0, rows)
        tried = tokens[nodes][:, None]
        # Deterministic: accepted with p(x), the residual p without x; proposed: min(1, p(x) / q(x)), max(0, p - q).
        hit, residual = current.gather(1, tried)[:, 0], current.scatter(1, tried, 0.0)
        if any_proposed:
            q = proposals.index_select(0, q_rows)
            hit = hit.index_copy(0, at, hit[at] / q.gather(1, tried[at])[:, 0])
            residual = residual.index_copy(0, at, (current.index_select(0, at) - q).clamp_min(0.0))
        accept[nodes] = hit
        total = residual.sum(-1, keepdim=True)
        p.index_copy_(0, rows, torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny),
                                           current))
    drawn = draw_uniforms([2 * k + 1 for k in sizes], [step.generator for step in steps], device)[draw_order]
    accepted = drawn[:num_nodes] < accept
    return torch.cat([accepted.long(), draw(p, drawn[num_nodes:]), _usable(p)])


def _tree_verdict(draft: Sequence[int], parents, flags: list[int], finals: list[int], usable: list[int]) -> Verdict:
    kids = _children(draft, parents)
    path: list[int] = []
    row = 0
    while (child := next((c for c in kids[row] if flags[c]), None)) is not None:
        path.append(child)
        row = child + 1
    if not usable[row]:
        raise _unusable()
    return Verdict([draft[i] for i in path] + [finals[row]], len(path), path)


def _chain_verdict(draft: Sequence[int], accepted: int, emitted: int, usable: int) -> Verdict:
    if not usable:
        raise _unusable()
    return Verdict([*draft[:accepted], emitted], accepted, list(range(accepted)))


def _unusable() -> RuntimeError:
    return RuntimeError("the target distribution has no finite mass to sample from")


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


def committed_logprobs(logits: torch.Tensor,
                       steps: Sequence[tuple[int, Verdict, int]]) -> list[list[TokenLogprob]]:
    """vLLM's raw logprobs for each (first row, verdict, how many alternatives) step of a pass: each committed
    token's log-probability under the log-softmax of the raw logits row that judged it (no temperature,
    controls or cuts), with that row's most likely tokens; every step's read with one copy to the host."""
    device, vocab = logits.device, logits.shape[-1]
    rows = [first + row for first, verdict, _ in steps for row in verdict.rows]
    tokens = [token for _, verdict, _ in steps for token in verdict.token_ids]
    logprobs = torch.log_softmax(logits[torch.tensor(rows, device=device)].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=device)[:, None])
    top = torch.topk(logprobs, min(max(num_top for _, _, num_top in steps), vocab), dim=-1)
    # One copy: the ids ride in float64, exact below 2^53.
    read = iter(torch.cat([chosen.double(), top.values.double(), top.indices.double()], dim=1).tolist())
    found, width = [], top.values.shape[1]
    for _, verdict, num_top in steps:
        entries = []
        for values in itertools.islice(read, len(verdict.token_ids)):
            entries.append(TokenLogprob(values[0], tuple(int(i) for i in values[1 + width: 1 + width + num_top]),
                                        tuple(values[1: 1 + num_top])))
        found.append(entries)
    return found
