"""The KV cache's memory on one rank: per attention layer, one preallocated
tensor of [num_blocks * block_size, kv_heads, key_dim + value_dim] (vLLM's
block layout, flattened to slots, a slot's key and value side by side), or
for an accelerator's kernels a keys tensor and a values tensor. A
sequence's token i lives in slot
`block_table[i // block_size] * block_size + i % block_size`; its KV is written
once, where it was computed, and moves only to compact an accepted tree path
(block_manager.MoveSlots)."""

import mmap
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
                 device: torch.device, split: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        g = geometry
        self.key_dim = g.key_dim
        # Per layer one tensor [slots, kv_heads, key_dim + value_dim]: a slot's key beside its value, so one copy
        # gathers both (a block's rows twice as long: gathers were the largest cost a decode pass adds to the
        # model's own). Zeros: attention reads whole blocks, so a slot never written is read (and masked); it
        # must be finite. Indexed by layer; a layer that keeps no KV has none.
        # split: keys and values in tensors of their own, each contiguous [slots, kv_heads, dim], the layout an
        # accelerator's paged kernels read (attention/ascend.py); then `kv` is None.
        rows = [0 if i in g.stateless else slots for i in range(g.num_layers)]
        if split:
            self.kv = None
            self.keys = [_zeros(n, g.kv_heads, g.key_dim, dtype=dtype, device=device) for n in rows]
            self.values = [_zeros(n, g.kv_heads, g.value_dim, dtype=dtype, device=device) for n in rows]
        else:
            self.kv = [_zeros(n, g.kv_heads, g.key_dim + g.value_dim, dtype=dtype, device=device) for n in rows]
            self.keys = [tensor[..., :g.key_dim] for tensor in self.kv]
            self.values = [tensor[..., g.key_dim:] for tensor in self.kv]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [n, kv_heads, dim] of the pass's new tokens, into their slots."""
        if self.kv is None:
            self.keys[layer].index_copy_(0, slots, keys)
            self.values[layer].index_copy_(0, slots, values)
        else:
            self.kv[layer].index_copy_(0, slots, torch.cat((keys, values), dim=-1))

    def move(self, move: MoveSlots) -> None:
        tensors = self.kv if self.kv is not None else self.keys + self.values
        src = torch.tensor(move.src, dtype=torch.long, device=tensors[0].device)
        dst = torch.tensor(move.dst, dtype=torch.long, device=tensors[0].device)
        for tensor in tensors:
            if len(tensor):
                tensor.index_copy_(0, dst, tensor.index_select(0, src))


def _zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on a CPU in an anonymous mapping, whose pages the kernel commits (zeroed) only as blocks fill, so
    a large --kv-cache-space costs memory as it is used, as torch.empty's would."""
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    count = shape[0] * shape[1] * shape[2]
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).view(shape)
