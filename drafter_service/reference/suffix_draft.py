"""Drafting from a position in a suffix tree (see suffix_tree.py for the node
layout): a position is (node, offset), `offset` tokens into node's edge.
Inside an edge the next token is certain; at a node, child c of node n is
taken with probability c.count / n.count.
"""

import heapq
from collections.abc import Sequence

from drafter_service.draft import MAX_DETOURS, Detour, Draft
from protos.conventions import chain_parents


def draft_path(node, offset: int, budget: int, min_token_prob: float, match_len: int,
               reanchor=None, pattern: Sequence[int] = (), visited: list | None = None) -> Draft:
    """Follows the most frequent continuation while the path probability stays >= min_token_prob.

    `pattern` is the matched context; where the walk runs out of tree,
    `reanchor(node, path)` may give a position to go on from (path = pattern +
    draft so far), or None to stop. `visited`, when given, gets the position
    each token was read from, then the position after the last.
    """
    token_ids, probs, prob = [], [], 1.0
    path = list(pattern)
    while len(token_ids) < budget:
        start = (node, offset)
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
        if visited is not None:
            visited.append(start)
    if visited is not None:
        visited.append((node, offset))
    return Draft(tuple(token_ids), chain_parents(len(token_ids)), tuple(probs), sum(probs), match_len)


def detours(draft: Draft, step_len: int, visited: list, budget_at, min_token_prob: float, reanchor,
            pattern: Sequence[int]) -> tuple[Detour, ...]:
    """The drafts after the likeliest other outcomes of a path draft's step (its first
    `step_len` tokens, read from the positions in `visited`): every other token the
    tree has seen after each prefix of the step, as likely as the tree says (the
    chance of reaching that prefix times the token's share there). `budget_at(m)`
    is a draft's budget after a match of m tokens, `pattern` the matched context.
    """
    outcomes = []  # (prob, position, token, node, offset after it)
    continued = len(draft.token_ids) > step_len  # its bonus token is offered
    for j in range(step_len + 1):
        node, offset = visited[j]
        reach = 1.0 if j == 0 else draft.probs[j - 1]
        taken = draft.token_ids[j] if j < step_len or continued else None
        if offset < node.length:
            token = node.tokens[node.start + offset]
            if token != taken:
                outcomes.append((reach, j, token, node, offset + 1))
            continue
        for child in node.ordered or ():
            token = child.tokens[child.start]
            if token != taken:
                outcomes.append((reach * (child.count / node.count), j, token, child, 1))
    outcomes.sort(key=lambda outcome: -outcome[0])  # stable: ties keep the walk's order
    found = []
    for _, position, token, node, offset in outcomes:
        if len(found) == MAX_DETOURS:
            break
        # As for the continuation: the match grows by the accepted tokens and the target's.
        path = [*pattern, *draft.token_ids[:position], token]
        after = draft_path(node, offset, budget_at(len(pattern) + position + 1), min_token_prob, 0, reanchor, path)
        if after.token_ids:
            found.append(Detour(position, token, after.token_ids, after.probs))
    return tuple(found)


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
