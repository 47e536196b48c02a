"""Suffix trie truncated at `max_depth` over several token sequences
(SuffixDecoding, Oliaro et al. 2025), path-compressed.

Pattern P (len(P) <= max_depth) counts its occurrences in the stored
sequences, i.e. the suffixes passing through it, so count(P + t) / count(P)
estimates how often t follows P. A node stands for a run of patterns with the
same count: its edge is `length` tokens read from `tokens` (the storage of a
sequence, or a private copy, holding the node's whole root path up to
start + length). Inside an edge the next token is certain (probability 1).

Every suffix of a stored sequence ends on a node boundary. That keeps counts
uniform along edges and lets `append` move each suffix on in O(1): grow its
leaf, slide its node's end one token down, or step into / split a child.

Children of non-root nodes are kept sorted by (count descending, first token
ascending): the most frequent child is first, and ties between equal counts go
to the SMALLER token id. Speculation never starts at the root (a match has
length >= 1), so the root, whose fan-out is the vocabulary, keeps no order.
"""

import math
from array import array
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import replace

from drafter_service.draft import Draft
from drafter_service.reference.suffix_draft import detours, draft_path, draft_tree


class _Node:
    __slots__ = ("count", "tokens", "start", "length", "depth", "children", "ordered")

    def __init__(self, tokens, start: int, length: int, depth: int, count: int):
        self.count = count
        self.tokens = tokens  # edge = tokens[start:start + length]
        self.start = start
        self.length = length
        self.depth = depth  # pattern length at the end of the edge
        self.children: dict[int, _Node] | None = None  # first edge token -> child
        self.ordered: list[_Node] | None = None  # children by _order_key


def _order_key(node: _Node) -> tuple[int, int]:
    return -node.count, node.tokens[node.start]


class _Sequence:
    __slots__ = ("tokens", "frontier")

    def __init__(self, root: _Node):
        self.tokens = array("i")
        # Nodes where this sequence's suffixes shorter than max_depth end, root first.
        self.frontier: list[_Node] = [root]


class SuffixTree:
    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth
        self._root = _Node(None, 0, 0, 0, 0)  # count stays 0: never a leaf to grow or slide
        self._sequences: dict[object, _Sequence] = {}
        self.num_nodes = 0  # excluding the root; memory grows with it

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._sequences

    def sequence_length(self, seq_id) -> int:
        return len(self._sequences[seq_id].tokens)

    def add_sequence(self, seq_id) -> None:
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._sequences[seq_id] = _Sequence(self._root)

    def append(self, seq_id, token_ids: Iterable[int]) -> None:
        """Appends tokens; each one extends every suffix ending before it: O(max_depth)."""
        sequence = self._sequences[seq_id]
        storage = sequence.tokens
        for token in token_ids:
            storage.append(token)
            pos = len(storage) - 1
            grown = [self._root]
            for node in sequence.frontier:
                if node.children is None and node.count == 1:
                    # A leaf only this suffix reaches (the common case, inlined for
                    # speed): grow its edge, read from our own storage.
                    node.tokens, node.start = storage, pos - node.length
                    node.length += 1
                    node.depth += 1
                else:
                    node = self._extend(node, storage, pos, token)
                if node.depth < self.max_depth:
                    grown.append(node)
            sequence.frontier = grown

    def remove_sequence(self, seq_id) -> None:
        """Forgets a sequence: walks each of its suffixes, O(len * max_depth)."""
        storage = self._sequences.pop(seq_id).tokens
        for start in range(len(storage)):
            end = min(len(storage), start + self.max_depth)
            parent, position, path = self._root, start, []
            while position < end:
                node = parent.children[storage[position]]
                position += node.length
                if self._recount(parent, node, -1):
                    self.num_nodes -= _chain_length(node)
                    break
                path.append(node)
                parent = node
            _relabel(path, storage)
            self._merge_path(path)

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of `pattern` (len <= max_depth) in the stored sequences."""
        position = self._match(pattern, 0, len(pattern))
        return 0 if position is None else position[0].count

    def pattern_counts(self) -> dict[tuple[int, ...], int]:
        """Every stored pattern with its count (for tests and debugging): O(size of the uncompressed trie)."""
        counts, stack = {}, [(self._root, ())]
        while stack:
            node, path = stack.pop()
            for child in (node.children or {}).values():
                child_path = path
                for index in range(child.start, child.start + child.length):
                    child_path += (child.tokens[index],)
                    counts[child_path] = child.count
                stack.append((child, child_path))
        return counts

    def speculate(
        self,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        use_tree: bool = False,
        reanchor: bool = True,
        lookahead: int = 0,
    ) -> Draft:
        """Best draft over all match lengths m of the context's tail.

        For each m = 1..min(len(context), max_depth) whose last-m tokens are in
        the trie, drafts up to min(max_spec_tokens, floor(factor * m + offset))
        tokens from there; returns the highest score, ties to the longer match.
        A length whose pattern occurs exactly as often as the next longer one's
        is skipped: it has the same occurrences, so the same continuations
        (unlike Arctic, which drafts from it again).
        With `reanchor`, a path draft reaching max_depth goes on from the last
        max_depth // 2 tokens of pattern + draft instead of stopping there, so
        its length is not capped at max_depth - m (tree drafts stop).
        With `lookahead`, a path draft cut by its budget goes on along the same
        path for up to that many tokens: the likely next token, then the next
        step's draft within the budget of the match that step would leave;
        `step_len` marks where this step's draft ends, and `score` is its own.
        A path draft then also offers `detours`, the drafts after the step's
        likeliest other outcomes (suffix_draft.detours).
        """
        if max_spec_factor < 0:
            raise ValueError("max_spec_factor must be >= 0")
        end = len(context)
        # The trie holds every substring of a stored pattern, so the matching
        # tail lengths are 1..longest: binary search for the longest.
        longest, too_long = 0, min(end, self.max_depth) + 1
        while too_long - longest > 1:
            middle = (longest + too_long) // 2
            if self._match(context, end - middle, end) is None:
                too_long = middle
            else:
                longest = middle
        def budget_at(match_len: int) -> int:
            return min(max_spec_tokens, math.floor(max_spec_factor * match_len + max_spec_offset))

        best, drafted_count, best_at = Draft(), 0, None
        for match_len in range(longest, 0, -1):
            budget = budget_at(match_len)
            if match_len < longest and budget <= best.score:
                break  # a score never exceeds its budget, which only shrinks from here: at best a tie
            node, offset = self._match(context, end - match_len, end)
            if node.count == drafted_count:
                continue  # the same occurrences as a longer match, with a smaller budget
            drafted_count = node.count
            if use_tree:
                draft = draft_tree(node, offset, budget, min_token_prob, match_len)
            else:
                draft = draft_path(node, offset, budget, min_token_prob, match_len,
                                   self._reanchor if reanchor else None, context[end - match_len:end])
            if match_len == longest or draft.score > best.score:
                best, best_at = draft, (node, offset, budget)
        drafted = len(best)
        if lookahead > 0 and not use_tree and drafted > 0:
            node, offset, budget = best_at
            pattern, reanchored = context[end - best.match_len:end], self._reanchor if reanchor else None
            # Cut by its budget, not by the path: the step after, should this one be accepted whole and the
            # target's next token be the path's, matches drafted + 1 tokens more, so its budget is larger.
            more = min(lookahead, 1 + max(0, budget_at(best.match_len + drafted + 1))) if drafted == budget else 0
            visited = []
            walked = draft_path(node, offset, drafted + more, min_token_prob, best.match_len, reanchored, pattern,
                                visited)
            if more > 0:
                best = replace(walked, score=best.score, step_len=drafted)
            best = replace(best, detours=detours(best, drafted, visited,
                                                 lambda m: min(lookahead - 1, budget_at(m)), min_token_prob,
                                                 reanchored, pattern))
        return best

    def _reanchor(self, node: _Node, path: list[int]) -> tuple[_Node, int] | None:
        """Where the trie's depth, not the stored text, ends a walk: the position of the
        last max_depth // 2 tokens, a suffix of a stored pattern, so always present."""
        anchor = self.max_depth // 2
        if node.depth < self.max_depth or anchor == 0:
            return None
        return self._match(path, len(path) - anchor, len(path))

    def _match(self, tokens: Sequence[int], start: int, end: int) -> tuple[_Node, int] | None:
        """Position (node, tokens of its edge matched) of tokens[start:end], or None."""
        node, offset = self._root, 0
        for index in range(start, end):
            token = tokens[index]
            if offset < node.length:
                if node.tokens[node.start + offset] != token:
                    return None
                offset += 1
            else:
                node = node.children.get(token) if node.children is not None else None
                if node is None:
                    return None
                offset = 1
        return node, offset

    def _extend(self, node: _Node, storage: array, pos: int, token: int) -> _Node:
        """Moves the suffix ending at `node` (not a leaf of its own) over `token` = storage[pos]."""
        children = node.children
        child = children.get(token) if children is not None else None
        if child is None:
            child = _Node(storage, pos, 1, node.depth + 1, 1)
            self._attach(node, child)
            return child
        if len(children) == 1 and child.count == node.count - 1 and (child.length > 1 or self._unpointed(child)):
            # Only this suffix ends at `node`, all others go on into `child`:
            # move node's end one token down instead of adding a boundary.
            self._lower_end(node, child)
            return node
        if child.length > 1:
            child = self._split(node, child)
        self._recount(node, child, +1)
        return child

    def _attach(self, parent: _Node, child: _Node) -> None:
        if parent.children is None:
            parent.children = {}
            if parent is not self._root:
                parent.ordered = []
        parent.children[child.tokens[child.start]] = child
        if parent.ordered is not None:
            insort(parent.ordered, child, key=_order_key)
        self.num_nodes += 1

    def _split(self, parent: _Node, child: _Node) -> _Node:
        """Cuts child's edge after its first token; returns the new upper node."""
        upper = _Node(child.tokens, child.start, 1, parent.depth + 1, child.count)
        self._replace(parent, child, upper)
        child.start += 1
        child.length -= 1
        upper.children = {child.tokens[child.start]: child}
        upper.ordered = [child]
        self.num_nodes += 1
        return upper

    def _unpointed(self, node: _Node) -> bool:
        """True if no frontier points at `node`: frontiers stop short of max_depth,
        and below it a node nobody's suffix ends at has no pointer either."""
        if node.depth >= self.max_depth:
            return True
        return node.ordered is not None and sum(child.count for child in node.ordered) == node.count

    def _lower_end(self, node: _Node, child: _Node) -> None:
        """Takes the first token of child's edge into node's; a one-token child goes whole."""
        node.tokens, node.start = child.tokens, child.start - node.length
        node.length += 1
        node.depth += 1
        if child.length > 1:
            child.start += 1
            child.length -= 1
            node.children = {child.tokens[child.start]: child}
        else:
            node.children, node.ordered = child.children, child.ordered
            self.num_nodes -= 1

    def _merge_path(self, path: list[_Node]) -> None:
        """Joins each node of a root path with its only child once their counts are
        equal. No suffix ends at such a node, so no frontier points at it: the child
        takes its place."""
        parent = self._root
        for node in path:
            if node.children is not None and len(node.children) == 1:
                (below,) = node.children.values()
                if below.count == node.count:
                    self._replace(parent, node, below)
                    below.start -= node.length
                    below.length += node.length
                    self.num_nodes -= 1
                    continue
            parent = node

    def _replace(self, parent: _Node, old: _Node, new: _Node) -> None:
        """Puts `new` where `old` was; both have the same count and first token."""
        parent.children[old.tokens[old.start]] = new
        if parent.ordered is not None:
            parent.ordered[bisect_left(parent.ordered, _order_key(old), key=_order_key)] = new

    def _recount(self, parent: _Node, child: _Node, delta: int) -> bool:
        """Changes child's count, keeping the order; returns True if that dropped the child."""
        ordered = parent.ordered
        if ordered is not None:
            del ordered[bisect_left(ordered, _order_key(child), key=_order_key)]
        child.count += delta
        if child.count == 0:
            del parent.children[child.tokens[child.start]]
            if not parent.children:
                parent.children = parent.ordered = None
            return True
        if ordered is not None:
            insort(ordered, child, key=_order_key)
        return False


def _chain_length(node: _Node) -> int:
    """Nodes in a subtree whose root has count 1: a single chain."""
    length = 1
    while node.children:
        (node,) = node.children.values()
        length += 1
    return length


def _relabel(path: list[_Node], storage: array) -> None:
    """Points path nodes that read from a removed sequence at one copy of the path."""
    copy = None
    for node in reversed(path):
        if node.tokens is storage:
            if copy is None:  # the deepest such node's root path covers its ancestors' too
                end = node.start + node.length
                copy = storage[end - node.depth:end]
            node.tokens, node.start = copy, node.depth - node.length
