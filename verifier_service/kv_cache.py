"""The KV cache's memory on one rank: per attention layer, one preallocated
keys tensor and one values tensor of [num_blocks * block_size, kv_heads, dim]
(vLLM's block layout, flattened to slots). A sequence's token i lives in slot
`block_table[i // block_size] * block_size + i % block_size`; its KV is written
once, where it was computed, and moves only to compact an accepted tree path
(block_manager.MoveSlots)."""

from dataclasses import dataclass

import torch

from verifier_service.block_manager import MoveSlots


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV on one rank."""

    num_layers: int
    kv_heads: int
    key_dim: int
    value_dim: int  # differs from key_dim under MLA (DeepSeek-V3)
    stateless: frozenset[int] = frozenset()  # layers that keep no KV (linear attention: linear_attention.py)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        layers = self.num_layers - len(self.stateless)
        return layers * self.kv_heads * (self.key_dim + self.value_dim) * torch.finfo(dtype).bits // 8


class PagedKVCache:
    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        g = geometry
        # Empty, not zeros: pages are only committed as blocks fill, and no slot is read before it is written.
        # Indexed by layer; a layer that keeps no KV has none.
        self.keys = [torch.empty(0 if i in g.stateless else slots, g.kv_heads, g.key_dim, dtype=dtype, device=device)
                     for i in range(g.num_layers)]
        self.values = [torch.empty(0 if i in g.stateless else slots, g.kv_heads, g.value_dim, dtype=dtype,
                                   device=device) for i in range(g.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [n, kv_heads, dim] of the pass's new tokens, into their slots."""
        self.keys[layer].index_copy_(0, slots, keys)
        self.values[layer].index_copy_(0, slots, values)

    def move(self, move: MoveSlots) -> None:
        src = torch.tensor(move.src, dtype=torch.long, device=self.keys[0].device)
        dst = torch.tensor(move.dst, dtype=torch.long, device=self.keys[0].device)
        for tensor in (*self.keys, *self.values):
            if len(tensor):
                tensor.index_copy_(0, dst, tensor.index_select(0, src))
