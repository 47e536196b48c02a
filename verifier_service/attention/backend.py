"""The attention backend interface: what the engine asks of a device's kernels.

Per pass, `prepare` turns the segments (block tables, lengths, draft trees)
into the backend's own metadata, once, on the device; per layer, `attend`
runs the whole batch's attention over the paged cache in one call. The KV of
the pass's new tokens is already in the cache when `attend` runs.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
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


class GraphedBackend(AttentionBackend, Protocol):
    """A backend whose passes replay from device graphs (graphs.py): it lays a pass out for a graph's size, builds
    its metadata over the graph's buffers, and updates in a captured graph what it cannot read from a tensor."""

    def graph_sizes(self, sizes: tuple[int, ...]) -> list: ...  # the GraphSizes captured for these token counts

    def graph_size(self, plan, sizes: tuple, block_size: int, width: int): ...  # the size that runs plan, or None

    def graph_inputs(self, plan, size, block_size: int, width: int, scratch_slot: int): ...  # a GraphInputs

    def graph_metadata(self, fields: dict[str, torch.Tensor], block_size: int, host, tasks) -> object: ...

    def graph_tasks(self) -> object: ...  # what a new graph records to update before replays (None: nothing)

    def update_graph(self, tasks, host) -> None: ...


def slot_mapping(segments: tuple[Segment, ...], block_size: int, device: torch.device) -> torch.Tensor:
    """[T] the flat cache slot of every new token of the pass."""
    slots = [slot(seg.block_table, i, block_size) for seg in segments
             for i in range(seg.start, seg.start + seg.num_tokens)]
    return torch.tensor(slots, dtype=torch.long, device=device)


# A graph's layout is built on the host before every replay, in a few array operations rather than a tensor per
# segment: for 64 sequences that took 0.47-0.57x the time for FlexAttention's and 0.22x for Ascend's (0.4-0.7 ms
# on this repository's CPU host; docs/benchmarks/verifier-engine, "A graph's layout on the host").
def within(counts: np.ndarray) -> np.ndarray:
    """For groups of counts[i] consecutive elements: each element's index in its group."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def table_rows(segments: tuple[Segment, ...], lengths: np.ndarray, rows: int, width: int, fill: int) -> np.ndarray:
    """[rows, width] int64: segment i's first lengths[i] blocks in row i, `fill` elsewhere."""
    tables = np.full((rows, width), fill, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(seg.block_table[:n] for seg, n in zip(segments, lengths.tolist())),
                       np.int64, int(lengths.sum()))
    tables[np.repeat(np.arange(len(segments)), lengths), within(lengths)] = flat
    return tables


def new_token_slots(tables: np.ndarray, starts: np.ndarray, counts: np.ndarray, block_size: int) -> np.ndarray:
    """[the segments' new tokens] int64: each one's cache slot (segment i's positions starts[i] .. starts[i] +
    counts[i], through row i of `tables`), segment after segment."""
    which = np.repeat(np.arange(len(counts)), counts)
    position = starts[which] + within(counts)
    return tables[which, position // block_size] * block_size + position % block_size
