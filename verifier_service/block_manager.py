"""The KV cache's blocks, as vLLM's v1 KV cache manager keeps them: a pool of
fixed-size blocks, a block table per sequence, automatic prefix caching.

A block is identified, once full of committed tokens, by a hash of its
parent block's hash and its tokens. Every running sequence whose prompt
starts with the same blocks shares them read-only (reference-counted); a
block whose last holder ends stays cached, evictable least recently used
first, until its space is needed. So a system prompt shared by concurrent
requests is computed once, and an agent's next turn resumes from its cached
blocks whichever request computed them.

Where a prompt leaves the cached blocks inside a block, the tokens it still
shares with a cached block of that place count too, as SGLang's token-granular
cache finds them: the prompt gets a block of its own with that block's first
matching slots copied in. Finished sequences' last blocks, partly full, stay
findable for this (tails). So a conversation's next turn, whose template
renders the last reply otherwise than it was generated, or which ends inside
a block, does not compute again the up to block_size - 1 tokens before that
point.

This module is rank 0's bookkeeping: it never touches a tensor. KV rows are
copied through `moves` (an accepted tree path's, inside its sequence's blocks;
a cached block's shared slots, into a new sequence's own block), which reach
every rank with the next pass and run before it, in order.
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class MoveSlots:
    """Copies the KV of flat slots `src[i]` to `dst[i]` in every layer."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


def block_hash(parent: bytes, tokens) -> bytes:
    """A full block's identity: its tokens and everything before them."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_hash(salt: str) -> bytes:
    """The parent of a sequence's first block: its cache salt, so that only equal salts share blocks."""
    return hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""


def slot(blocks, index: int, block_size: int) -> int:
    """The flat cache slot of a sequence's token `index`, through its blocks."""
    return blocks[index // block_size] * block_size + index % block_size


class BlockTable:
    """One sequence's blocks, and the hashes of those that are full and committed."""

    def __init__(self, salt: str = ""):
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []
        self.root = root_hash(salt)

    def slot(self, index: int, block_size: int) -> int:
        return slot(self.blocks, index, block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block, for blocks in use or evictable
        # Cached blocks by their parent's hash, full ones and tails (a finished sequence's last, partly full
        # block, free): parent hash -> {block: its tokens}; and each such block's parent.
        self._children: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._parent_of: dict[int, bytes] = {}
        # Blocks no sequence holds, least recently freed first: evictable cached ones and empty ones alike.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_free_cached = 0
        self.moves: list[MoveSlots] = []
        self.prefix_cache_queries = 0  # prompt tokens looked up, and of them found, since start (vLLM's counters)
        self.prefix_cache_hits = 0

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds (some of them hold cached prefixes)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self._num_free_cached

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    def allocate(self, table: BlockTable, tokens, num_tokens: int, headroom_blocks: int = 0) -> int | None:
        """Gives a new sequence blocks for `num_tokens`, sharing the cached ones
        that hold the start of `tokens` and copying the slots it shares with a
        cached block after them; returns how many tokens its blocks then hold
        (the sequence computes the rest), or None when the cache cannot spare
        the blocks and keep `headroom_blocks` free."""
        hits, parent = self._cached_prefix(tokens, table.root) if self.enable_prefix_caching else ([], b"")
        start = len(hits) * self.block_size
        # A cached block continuing the hits part of the way: its matching tokens, never the prompt's last.
        source, matched = self._partial_match(parent, tokens[start:len(tokens) - 1]) \
            if self.enable_prefix_caching else (None, 0)
        # Hit blocks that were free come out of the free pool: they must be counted as needed too.
        reused_free = sum(1 for block in hits if self._refs[block] == 0)
        needed = self.blocks_for(num_tokens) - len(hits)
        if needed + reused_free + headroom_blocks > len(self._free):
            return None
        for block in hits:
            self._hold(block)
        table.blocks = hits + [self._take() for _ in range(needed)]
        table.hashes = [self._hash_of[block] for block in hits]
        if matched:
            # Copied before the pass that computes the rest of the block (moves go first, in order); a free
            # source may have been taken just now, but nothing writes it before then.
            own = table.blocks[len(hits)]
            self.moves.append(MoveSlots(tuple(source * self.block_size + i for i in range(matched)),
                                        tuple(own * self.block_size + i for i in range(matched))))
        num_cached = start + matched
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(tokens)
            self.prefix_cache_hits += num_cached
        return num_cached

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Makes the table hold at least `num_tokens`; False (unchanged) when no blocks are free."""
        extra = self.blocks_for(num_tokens) - len(table.blocks)
        if extra > len(self._free):
            return False
        table.blocks += [self._take() for _ in range(max(extra, 0))]
        return True

    def reachable(self, table: BlockTable) -> int:
        """Most tokens the table could hold with every free block."""
        return (len(table.blocks) + len(self._free)) * self.block_size

    def commit(self, table: BlockTable, tokens, num_computed: int) -> None:
        """Registers the blocks that `num_computed` committed tokens (with their
        KV in place) now fill, so that later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        while len(table.hashes) < num_computed // size:
            i = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else table.root
            held = tuple(tokens[i * size:(i + 1) * size])
            digest = block_hash(parent, held)
            table.hashes.append(digest)
            block = table.blocks[i]
            if self._hash_of[block] is None and digest not in self._cached:
                self._hash_of[block] = digest
                self._cached[digest] = block
                self._adopt(block, parent, held)

    def free(self, table: BlockTable, tokens=(), num_computed: int = 0) -> None:
        """Gives a sequence's blocks back: cached ones stay findable until evicted,
        and so does its last block's part holding `num_computed` committed
        tokens' KV. The last blocks go back first, so that a prefix's first
        blocks, which more prompts share, are evicted last."""
        size = self.block_size
        full, rest = divmod(num_computed, size)
        if (self.enable_prefix_caching and rest and len(table.hashes) == full and full < len(table.blocks)
                and self._refs[table.blocks[full]] == 1):
            self._adopt(table.blocks[full], table.hashes[-1] if table.hashes else table.root,
                        tuple(tokens[full * size:num_computed]))
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                self._num_free_cached += self._holds_cache(block)
        table.blocks, table.hashes = [], []

    def take_moves(self) -> list[MoveSlots]:
        moves, self.moves = self.moves, []
        return moves

    def check(self) -> None:
        """Raises AssertionError where the bookkeeping disagrees with itself (tests)."""
        assert all(ref >= 0 for ref in self._refs)
        assert {b for b in range(self.num_blocks) if self._refs[b] == 0} == set(self._free)
        assert all(self._hash_of[block] == digest for digest, block in self._cached.items())
        assert all(block in self._children[parent] for block, parent in self._parent_of.items())
        assert sum(len(children) for children in self._children.values()) == len(self._parent_of)
        assert all(block in self._free for block in self._parent_of if self._hash_of[block] is None)  # tails
        assert self._num_free_cached == sum(1 for block in self._free if self._holds_cache(block))

    def cached_tokens(self, tokens, salt: str = "") -> int:
        """How many of `tokens`' first tokens the cache holds now for `salt` (whole blocks)."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._cached_prefix(tokens, root_hash(salt))[0]) * self.block_size

    def _cached_prefix(self, tokens, root: bytes) -> tuple[list[int], bytes]:
        """The cached blocks holding `tokens`' first full blocks, and the hash
        of the last (the root where none). The last token is never among them:
        it must run to give the next token's logits."""
        size, parent, hits = self.block_size, root, []
        for i in range((len(tokens) - 1) // size):
            digest = block_hash(parent, tokens[i * size:(i + 1) * size])
            block = self._cached.get(digest)
            if block is None:
                break
            hits.append(block)
            parent = digest
        return hits, parent

    def _adopt(self, block: int, parent: bytes, tokens: tuple[int, ...]) -> None:
        self._children.setdefault(parent, {})[block] = tokens
        self._parent_of[block] = parent

    def _partial_match(self, parent: bytes, tokens) -> tuple[int | None, int]:
        """The cached block under `parent` that starts with most of `tokens`, and how many."""
        best, matched = None, 0
        for block, held in self._children.get(parent, {}).items():
            n = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b), min(len(held), len(tokens)))
            if n > matched:
                best, matched = block, n
        return best, matched

    def _holds_cache(self, block: int) -> bool:
        return self._hash_of[block] is not None or block in self._parent_of

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
            self._num_free_cached -= 1  # a hit: it holds a cached prefix
        self._refs[block] += 1

    def _take(self) -> int:
        """A free block for new tokens: the least recently freed, its cached prefix forgotten."""
        block, _ = self._free.popitem(last=False)
        self._num_free_cached -= self._holds_cache(block)
        digest = self._hash_of[block]
        if digest is not None:
            del self._cached[digest]
            self._hash_of[block] = None
        parent = self._parent_of.pop(block, None)
        if parent is not None:
            children = self._children[parent]
            del children[block]
            if not children:
                del self._children[parent]
        self._refs[block] = 1
        return block
