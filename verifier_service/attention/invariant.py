"""Batch-invariant attention over the paged cache (--batch-invariant): each
segment attended on its own, its keys gathered into sequence order, in the
operations whose results do not depend on the rest of the pass
(batch_invariant.segment_attention). One call per segment, not per batch:
invariance is what this mode buys, at that price. The gathers are one per
layer for the whole pass: each segment's keys as a run of whole blocks of
KEY_BLOCK positions, which the values are weighted in (a segment's run padded
with copies of its last key, which weigh 0)."""

from dataclasses import dataclass

import torch

from verifier_service.attention.backend import LayerCall, slot_mapping
from verifier_service.batch import PassInputs, Segment
from verifier_service.batch_invariant import KEY_BLOCK, UNSUPPORTED, KeyOrder, key_order, segment_attention
from verifier_service.kv_cache import PagedKVCache


@dataclass(frozen=True)
class SegmentKeys:
    rows: slice  # the segment's rows in the pass
    start: int
    keys: slice  # its run in Metadata.key_slots
    order: KeyOrder


@dataclass(frozen=True)
class Metadata:
    slot_mapping: torch.Tensor
    key_slots: torch.Tensor  # every segment's keys' slots in sequence order, a run of whole key blocks each
    segments: tuple[SegmentKeys, ...]


class InvariantAttention:
    name = "batch-invariant"
    split_kv = False

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        keys, slots, run = [], [], 0
        for seg, offset in zip(segments, inputs.offsets):
            length = seg.start + seg.num_tokens
            index = torch.arange(-(-length // KEY_BLOCK) * KEY_BLOCK).clamp(max=length - 1)
            table = torch.tensor(seg.block_table, dtype=torch.long)
            slots.append(table[index // block_size] * block_size + index % block_size)
            keys.append(SegmentKeys(slice(offset, offset + seg.num_tokens), seg.start, slice(run, run + len(index)),
                                    key_order(seg.num_pending, seg.parents, device)))
            run += len(index)
        return Metadata(slot_mapping(segments, block_size, device), torch.cat(slots).to(device), tuple(keys))

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        if call.sliding_window or call.softcap or call.sinks is not None:
            raise ValueError(UNSUPPORTED)
        rows = [t[metadata.key_slots].transpose(0, 1)[None] for t in (cache.keys[call.layer], cache.values[call.layer])]
        # [kv_heads, keys, dim] each: a segment's run is a view whose rows per head are contiguous.
        keys, values = (t[0].contiguous() for t in call.keys_values(*rows))
        out = None
        for seg in metadata.segments:
            attended = segment_attention(query[seg.rows].transpose(0, 1), keys[:, seg.keys], values[:, seg.keys],
                                         seg.start, seg.order, call.scaling)
            if out is None:
                out = query.new_empty(query.shape[0], query.shape[1], attended.shape[-1])
            out[seg.rows] = attended.transpose(0, 1)
        return out
