"""EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees"). A chain bets every draft token on
the head's first choice; a tree also verifies its runners-up, and a verify pass
accepts the longest path that matches. The head's confidence tracks
acceptance, so the tree grows where the head is sure:

- expand: at each depth the `topk` nodes with the highest path probability
  (the product of the head's probabilities from the root) each get their
  `topk` most likely children, all in one batched head step (with every
  other sequence's level);
- rerank: of every node seen, verify those with the highest path
  probability, as long as each still pays for its verification (below) and at
  most `max_nodes`. A child's path probability never exceeds its parent's, so
  the nodes kept always form a tree.

The tree is chosen without drawing anything, so the verifier judges it as a
deterministic draft (accept x with p(x), else drop x and try its sibling):
exact for greedy and for sampling alike."""

from dataclasses import dataclass, field

import torch

from speclane.speculation import draft_value
from verifier_service.config import TreeShape
from verifier_service.heads.head import Head
from verifier_service.heads.layer import HeadKV, KVBatch


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


@dataclass
class _Growing:
    """One sequence's tree while it grows: its nodes, and the frontier whose children its rows of the level's
    head output predict."""

    kv: HeadKV
    position: int  # of the last committed pair, whose head output predicts the first level
    depth: int
    temperature: float | None
    committed: int  # its KV entries before the expansion's
    nodes: _Nodes = field(default_factory=lambda: _Nodes([], [], [], []))
    frontier: list[int] = field(default_factory=lambda: [-1])  # -1: the last committed token
    frontier_probs: list[float] = field(default_factory=lambda: [1.0])
    expanded: list[int] = field(default_factory=list)  # nodes with a KV entry, in entry order


def draft_trees(head: Head, hidden: torch.Tensor, kvs: list[HeadKV], positions: list[int], depths: list[int],
                temperatures: list[float | None], shape: TreeShape, token_cost: float) -> list[DraftTree]:
    """A tree for each sequence, of at most depths[i] levels after its last committed token, whose head output
    hidden[i] at positions[i] predicts the first level. Every sequence's level goes through one head step
    together, and its choices are read with one copy to the host. The expansion's KV entries are left in
    `kvs` for the caller to roll back."""
    device = hidden.device
    vocab_map = head.draft_token_ids
    trees = [_Growing(kv, position, depth, temperature, len(kv))
             for kv, position, depth, temperature in zip(kvs, positions, depths, temperatures)]
    growing = trees  # the trees whose frontiers are the rows of `hidden`, in order
    for level in range(1, max(depths) + 1):
        logits = head.logits(hidden).float()
        temperature = torch.tensor([tree.temperature or 1.0 for tree in growing for _ in tree.frontier],
                                   dtype=logits.dtype, device=device)
        top_probs, top_ids = torch.softmax(logits / temperature[:, None], dim=-1).topk(
            min(shape.topk, logits.shape[-1]), dim=-1)
        if vocab_map is not None:
            top_ids = vocab_map[top_ids]
        # Token ids are exact in fp32 (below 2**24), so the probabilities and ids travel in one copy.
        probs, ids = torch.stack([top_probs, top_ids.to(top_probs.dtype)]).tolist()
        going, tokens, parent_rows, new_positions, masks, first = [], [], [], [], [], 0
        for tree in growing:
            nodes, rows = tree.nodes, range(first, first + len(tree.frontier))
            first += len(rows)
            children = [nodes.add(int(token), parent, parent_prob * prob)
                        for parent, parent_prob, row in zip(tree.frontier, tree.frontier_probs, rows)
                        for prob, token in zip(probs[row], ids[row])]
            if level == tree.depth:
                continue
            frontier = sorted(children, key=lambda node: -nodes.path_probs[node])[: shape.topk]
            kept, score = _rerank(nodes, shape.max_nodes, token_cost)
            # A deeper node's path probability is at most its parent's: none can pay once these do not.
            if nodes.path_probs[frontier[0]] <= token_cost * draft_value(score, len(kept), token_cost):
                continue
            row_of = {node: row for node, row in zip(tree.frontier, rows)}
            parent_rows += [row_of[nodes.parents[node]] for node in frontier]
            tokens += [nodes.tokens[node] for node in frontier]
            new_positions += [tree.position + level] * len(frontier)
            masks.append(_ancestor_mask(nodes, frontier, tree.expanded, tree.committed, device))
            tree.expanded.extend(frontier)
            tree.frontier, tree.frontier_probs = frontier, [nodes.path_probs[node] for node in frontier]
            going.append(tree)
        if not going:
            break
        hidden = head(torch.tensor(tokens, device=device), hidden[parent_rows],
                      torch.tensor(new_positions, device=device),
                      KVBatch([tree.kv for tree in going], [len(tree.frontier) for tree in going], masks))
        growing = going
    return [_kept_tree(tree.nodes, shape, token_cost) for tree in trees]


def _kept_tree(nodes: _Nodes, shape: TreeShape, token_cost: float) -> DraftTree:
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
