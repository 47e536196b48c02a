"""Draft token trees: `parents[i]` is the index of token i's parent inside the
draft, -1 for a child of the last committed token. Parents come before their
children, so a chain is parents = (-1, 0, 1, ...) and any prefix of a tree is
a tree. Positions are prefix + depth; a node sees only its ancestors."""

import torch


def is_chain(parents) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents) -> list[int]:
    """Depth of each node; children of the last committed token have depth 1."""
    result: list[int] = []
    for parent in parents:
        result.append(1 if parent < 0 else result[parent] + 1)
    return result


def children(parents) -> list[list[int]]:
    """children[0] are the root's children (the last committed token);
    children[i + 1] are node i's, in draft order."""
    result: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        result[parent + 1].append(i)
    return result


def ancestors(parents) -> list[list[int]]:
    """Each node's path from the root's child down to the node itself."""
    result: list[list[int]] = []
    for i, parent in enumerate(parents):
        result.append((result[parent] if parent >= 0 else []) + [i])
    return result


def ancestor_mask(parents) -> torch.Tensor:
    """[k, k] bool: node i may attend node j when j is i or one of its ancestors."""
    k = len(parents)
    mask = torch.zeros(k, k, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def check_parents(parents, k: int) -> str | None:
    """Why `parents` is not a tree of k nodes in topological order, or None."""
    if len(parents) != k:
        return f"draft has {k} tokens but {len(parents)} parents"
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            return f"parent {parent} of draft token {i} must be -1 or the index of an earlier token"
    return None


def keep_nodes(parents, keep: list[int]) -> tuple[int, ...]:
    """Parents of the sub-tree made of the nodes `keep` (sorted, closed under ancestors), re-indexed."""
    new_index = {old: new for new, old in enumerate(keep)}
    return tuple(-1 if parents[old] < 0 else new_index[parents[old]] for old in keep)
