"""EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees"). A chain bets every draft token on
the head's first choice; a tree also verifies its runners-up, and a verify pass
accepts the longest path that matches. The head's confidence tracks
acceptance, so the tree grows where the head is sure:

- expand: at each depth the `topk` nodes with the highest path probability
  (the product of the head's probabilities from the root) each get their
  `topk` most likely children, all in one batched head step;
- rerank: of every node seen, verify those with the highest path
  probability, as long as each still pays for its verification (below) and at
  most `max_nodes`. A child's path probability never exceeds its parent's, so
  the nodes kept always form a tree.

The tree is chosen without drawing anything, so the verifier judges it as a
deterministic draft (accept x with p(x), else drop x and try its sibling):
exact for greedy and for sampling alike."""

from dataclasses import dataclass

import torch

from speclane.speculation import draft_value
from verifier_service.config import TreeShape
from verifier_service.heads.head import Head
from verifier_service.heads.layer import HeadKV


@dataclass(frozen=True)
class DraftTree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]  # tree.py's convention: parents first, -1 the last committed token
    score: float  # expected accepted tokens: the kept nodes' path probabilities summed


@dataclass
class _Nodes:
    """Every node the expansion has seen, in the order they were made."""

    tokens: list[int]
    parents: list[int]
    path_probs: list[float]
    depths: list[int]

    def add(self, token: int, parent: int, path_prob: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.path_probs.append(path_prob)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1


def draft_tree(head: Head, hidden: torch.Tensor, kv: HeadKV, position: int, depth: int, shape: TreeShape,
               temperature: float | None, token_cost: float) -> DraftTree:
    """A tree of at most `depth` levels after the last committed token, whose
    head output `hidden` [1, H] at `position` predicts the first level. The
    expansion's KV entries are left in `kv` for the caller to roll back."""
    device = hidden.device
    vocab_map = head.draft_token_ids
    nodes = _Nodes([], [], [], [])
    frontier, frontier_probs = [-1], [1.0]  # the nodes whose children the rows of `hidden` predict
    row_of: dict[int, int] = {}  # the row of `hidden` each node of the last expanded level is at
    expanded: list[int] = []  # nodes with a KV entry, in entry order after the committed ones
    committed = len(kv)
    for level in range(1, depth + 1):
        logits = head.logits(hidden).float()
        probs = torch.softmax(logits / temperature if temperature else logits, dim=-1)
        top_probs, top_ids = probs.topk(min(shape.topk, probs.shape[-1]), dim=-1)
        if vocab_map is not None:
            top_ids = vocab_map[top_ids]
        children = [nodes.add(token, parent, parent_prob * prob)
                    for parent, parent_prob, row_probs, row_ids in zip(frontier, frontier_probs, top_probs.tolist(),
                                                                       top_ids.tolist())
                    for prob, token in zip(row_probs, row_ids)]
        if level == depth:
            break
        frontier = sorted(children, key=lambda node: -nodes.path_probs[node])[: shape.topk]
        kept, score = _rerank(nodes, shape.max_nodes, token_cost)
        # A deeper node's path probability is at most its parent's: none can pay once these do not.
        if nodes.path_probs[frontier[0]] <= token_cost * draft_value(score, len(kept), token_cost):
            break
        parent_rows = [row_of.get(nodes.parents[node], 0) for node in frontier]  # the root's children: row 0
        mask = _ancestor_mask(nodes, frontier, expanded, committed, device)
        hidden = head(torch.tensor([nodes.tokens[node] for node in frontier], device=device), hidden[parent_rows],
                      torch.full((len(frontier),), position + level, device=device), kv, mask=mask)
        expanded.extend(frontier)
        row_of = {node: row for row, node in enumerate(frontier)}
        frontier_probs = [nodes.path_probs[node] for node in frontier]
    kept, score = _rerank(nodes, shape.max_nodes, token_cost)
    kept.sort(key=lambda node: (nodes.depths[node], -nodes.path_probs[node]))  # parents first, likelier first
    index = {node: i for i, node in enumerate(kept)}
    return DraftTree(tuple(nodes.tokens[node] for node in kept),
                     tuple(index.get(nodes.parents[node], -1) for node in kept), score)


def _rerank(nodes: _Nodes, max_nodes: int, token_cost: float) -> tuple[list[int], float]:
    """The nodes to verify and their expected accepted tokens: the likeliest
    paths first, each while its chance of being accepted beats what its
    verification costs at the worth so far (draft_value, as a chain's draft
    stops). Ties go to the shallower node, so a parent precedes its child."""
    order = sorted(range(len(nodes.tokens)), key=lambda node: (-nodes.path_probs[node], nodes.depths[node]))
    kept: list[int] = []
    score = 0.0
    for node in order[:max_nodes]:
        if nodes.path_probs[node] <= token_cost * draft_value(score, len(kept), token_cost):
            break
        kept.append(node)
        score += nodes.path_probs[node]
    return kept, score


def _ancestor_mask(nodes: _Nodes, frontier: list[int], expanded: list[int], committed: int,
                   device) -> torch.Tensor:
    """[len(frontier), committed + len(expanded) + len(frontier)]: each new row
    sees the committed entries, its ancestors' entries and its own."""
    slot = {node: committed + i for i, node in enumerate([*expanded, *frontier])}
    mask = torch.zeros(len(frontier), committed + len(slot), dtype=torch.bool)
    mask[:, :committed] = True
    for row, node in enumerate(frontier):
        while node >= 0:
            mask[row, slot[node]] = True
            node = nodes.parents[node]
    return mask.to(device)
