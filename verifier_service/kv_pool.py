"""The KV budget: blocks of `block_size` tokens, held by admitted sequences
or by the prefix cache, allocated on rank 0.

A sequence holds enough blocks for every token it has in the KV store,
including a step's draft tokens. Blocks of finished sequences stay in a
prefix cache (least recently used first out) until their space is needed, so
a request whose prompt extends an earlier conversation adopts that KV slot
instead of prefilling it again. Store changes (frees, compactions) queue up
in `ops` and reach every rank with the next forward pass.
"""

from collections import OrderedDict
from dataclasses import dataclass

from speclane.tokens import common_prefix
from verifier_service.kv_store import Free, KVOp


@dataclass(frozen=True)
class Reuse:
    slot: int
    num_tokens: int  # cached tokens shared with the new prompt


class KVPool:
    def __init__(self, max_tokens: int, block_size: int, prefix_caching: bool = True):
        if max_tokens < block_size:
            raise ValueError(f"the KV budget ({max_tokens} tokens) is smaller than one block ({block_size})")
        self.block_size = block_size
        self.num_blocks = max_tokens // block_size
        self.prefix_caching = prefix_caching
        self._held: dict[int, int] = {}  # slot of an admitted sequence -> blocks
        self._cached: OrderedDict[int, tuple[tuple[int, ...], int]] = OrderedDict()  # slot -> (tokens, blocks)
        self._next_slot = 0
        self.ops: list[KVOp] = []

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        """Blocks of admitted sequences (the prefix cache gives its blocks up on demand)."""
        return sum(self._held.values())

    @property
    def cached_blocks(self) -> int:
        return sum(blocks for _, blocks in self._cached.values())

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks - self.cached_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    def allocate(self, num_tokens: int, headroom_blocks: int = 0) -> int | None:
        """A new slot with room for `num_tokens`, or None when the budget is full
        or would keep fewer than `headroom_blocks` free afterwards."""
        blocks = self.blocks_for(num_tokens)
        if not self._make_room(blocks + headroom_blocks):
            return None
        slot = self._next_slot
        self._next_slot += 1
        self._held[slot] = blocks
        return slot

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Makes the slot hold at least `num_tokens`; False (unchanged) when the budget is full."""
        extra = self.blocks_for(num_tokens) - self._held[slot]
        if extra <= 0:
            return True
        if not self._make_room(extra):
            return False
        self._held[slot] += extra
        return True

    def reachable(self, slot: int) -> int:
        """Most tokens the slot could hold after evicting the whole prefix cache."""
        return (self._held[slot] + self.free_blocks + self.cached_blocks) * self.block_size

    def release(self, slot: int, cached_tokens=()) -> None:
        """Ends a sequence: its blocks go to the prefix cache (when they hold tokens
        worth reusing) or are freed."""
        blocks = self._held.pop(slot)
        if self.prefix_caching and len(cached_tokens) >= self.block_size:
            self._cached[slot] = (tuple(cached_tokens), blocks)
        else:
            self.ops.append(Free(slot))

    def adopt(self, prompt) -> Reuse | None:
        """Takes over the cached slot sharing the longest prefix (at least a
        block) with `prompt`; the caller overwrites the rows past the match."""
        best, best_len = None, 0
        for slot, (tokens, _) in self._cached.items():
            # The last prompt token must still run, to produce the next token's logits.
            shared = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if shared > best_len:
                best, best_len = slot, shared
        if best is None or best_len < self.block_size:
            return None
        _, blocks = self._cached.pop(best)
        self._held[best] = blocks
        return Reuse(best, best_len)

    def take_ops(self) -> list[KVOp]:
        ops, self.ops = self.ops, []
        return ops

    def _make_room(self, blocks: int) -> bool:
        if blocks > self.free_blocks + self.cached_blocks:
            return False
        while self.free_blocks < blocks:
            slot, _ = self._cached.popitem(last=False)
            self.ops.append(Free(slot))
        return True
