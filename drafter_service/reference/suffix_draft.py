"""Drafting from a position in a suffix tree (see suffix_tree.py for the node
layout): a position is (node, offset), `offset` tokens into node's edge.
Inside an edge the next token is certain; at a node, child c of node n is
taken with probability c.count / n.count.
"""

import heapq
from collections.abc import Sequence

from drafter_service.draft import Draft
from protos.conventions import chain_parents


def draft_path(node, offset: int, budget: int, min_token_prob: float, match_len: int,
               reanchor=None, pattern: Sequence[int] = ()) -> Draft:
    """Follows the most frequent continuation while the path probability stays >= min_token_prob.

    `pattern` is the matched context; where the walk runs out of tree,
    `reanchor(node, path)` may give a position to go on from (path = pattern +
    draft so far), or None to stop.
    """
    token_ids, probs, prob = [], [], 1.0
    path = list(pattern)
    while len(token_ids) < budget:
        if offset < node.length:
            token = node.tokens[node.start + offset]
            offset += 1
        elif node.ordered:
            child = node.ordered[0]
            prob = prob * (child.count / node.count)
            if prob < min_token_prob:
                break
            node, offset, token = child, 1, child.tokens[child.start]
        elif reanchor is not None and (position := reanchor(node, path)) is not None:
            node, offset = position
            continue
        else:
            break
        token_ids.append(token)
        probs.append(prob)
        path.append(token)
    return Draft(tuple(token_ids), chain_parents(len(token_ids)), tuple(probs), sum(probs), match_len)


def draft_tree(node, offset: int, budget: int, min_token_prob: float, match_len: int) -> Draft:
    """Best-first expansion: takes up to `budget` continuations in order of
    (path prob desc, token path asc) among those with prob >= min_token_prob.

    A candidate enters the heap only once its predecessor in that order (its
    parent or previous sibling) was taken, so each step pushes at most two.
    """
    token_ids, parents, probs = [], [], []
    heap = []  # (-prob, token path, node, offset, sibling parent, index, parent prob, parent's output index)

    def push_child(parent, index: int, parent_prob: float, path: tuple, parent_out: int):
        child = parent.ordered[index]
        prob = parent_prob * (child.count / parent.count)
        heapq.heappush(heap, (-prob, path + (child.tokens[child.start],), child, 1,
                              parent, index, parent_prob, parent_out))

    def push_next(node, offset: int, prob: float, path: tuple, out: int):
        if offset < node.length:  # inside an edge: one way on, no siblings
            token = node.tokens[node.start + offset]
            heapq.heappush(heap, (-prob, path + (token,), node, offset + 1, None, 0, prob, out))
        elif node.ordered:
            push_child(node, 0, prob, path, out)

    if budget > 0:
        push_next(node, offset, 1.0, (), -1)
    while heap and len(token_ids) < budget:
        neg_prob, path, node, offset, parent, index, parent_prob, parent_out = heapq.heappop(heap)
        if -neg_prob < min_token_prob:
            break
        out = len(token_ids)
        token_ids.append(path[-1])
        parents.append(parent_out)
        probs.append(-neg_prob)
        if parent is not None and index + 1 < len(parent.ordered):
            push_child(parent, index + 1, parent_prob, path[:-1], parent_out)
        push_next(node, offset, -neg_prob, path, out)
    return Draft(tuple(token_ids), tuple(parents), tuple(probs), sum(probs), match_len)
