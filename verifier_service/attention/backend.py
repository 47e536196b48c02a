"""The attention backend interface: what the engine asks of a device's kernels.

Per pass, `prepare` turns the segments (block tables, lengths, draft trees)
into the backend's own metadata, once, on the device; per layer, `attend`
runs the whole batch's attention over the paged cache in one call. The KV of
the pass's new tokens is already in the cache when `attend` runs.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from verifier_service.batch import PassInputs, Segment
from verifier_service.block_manager import slot
from verifier_service.kv_cache import PagedKVCache


@dataclass(frozen=True)
class LayerCall:
    """What one layer's attention adds to the shared metadata (transformers passes these)."""

    layer: int
    scaling: float
    sliding_window: int | None = None  # a key is seen while query position - key position < window
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None  # [heads] logits of a virtual key with no value (GPT-OSS)
    # MLA: turns cache rows [B, 1, n, latent] into keys and values [B, heads, n, dim] (mla.py)
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def keys_values(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, kv_heads, n, dim] rows read from the cache, as the layer attends to them."""
        return self.expand(keys) if self.expand is not None else (keys, values)


class AttentionBackend(Protocol):
    name: str
    split_kv: bool  # reads keys and values from tensors of their own (PagedKVCache(split=True))

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> object: ...

    def attend(self, metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """query [T, heads, key_dim] of the pass's tokens; returns [T, heads, value_dim]."""
        ...


def slot_mapping(segments: tuple[Segment, ...], block_size: int, device: torch.device) -> torch.Tensor:
    """[T] the flat cache slot of every new token of the pass."""
    slots = [slot(seg.block_table, i, block_size) for seg in segments
             for i in range(seg.start, seg.start + seg.num_tokens)]
    return torch.tensor(slots, dtype=torch.long, device=device)
