"""Batch-invariant attention over the paged cache (--batch-invariant): each
segment attended on its own, its keys gathered into sequence order, in the
operations whose results do not depend on the rest of the pass
(batch_invariant.segment_attention). One call per segment, not per batch:
invariance is what this mode buys, at that price."""

from dataclasses import dataclass

import torch

from verifier_service.attention.backend import LayerCall, slot_mapping
from verifier_service.batch import PassInputs, Segment
from verifier_service.batch_invariant import KeyOrder, key_order, segment_attention
from verifier_service.kv_cache import PagedKVCache


@dataclass(frozen=True)
class SegmentKeys:
    rows: slice  # the segment's rows in the pass
    start: int
    key_slots: torch.Tensor  # [start + n] its keys' slots in sequence order
    order: KeyOrder


@dataclass(frozen=True)
class Metadata:
    slot_mapping: torch.Tensor
    segments: tuple[SegmentKeys, ...]


class InvariantAttention:
    name = "batch-invariant"
    split_kv = False

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        keys = []
        for seg, offset in zip(segments, inputs.offsets):
            index = torch.arange(seg.start + seg.num_tokens)
            table = torch.tensor(seg.block_table, dtype=torch.long)
            slots = (table[index // block_size] * block_size + index % block_size).to(device)
            keys.append(SegmentKeys(slice(offset, offset + seg.num_tokens), seg.start, slots,
                                    key_order(seg.num_pending, seg.parents, device)))
        return Metadata(slot_mapping(segments, block_size, device), tuple(keys))

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        if call.sliding_window or call.softcap or call.sinks is not None:
            raise NotImplementedError("batch-invariant attention has no sliding window, softcapping or sinks")
        keys, values = cache.keys[call.layer], cache.values[call.layer]
        out = None
        for seg in metadata.segments:
            k, v = (t[0].contiguous() for t in call.keys_values(keys[seg.key_slots].transpose(0, 1)[None],
                                                                values[seg.key_slots].transpose(0, 1)[None]))
            attended = segment_attention(query[seg.rows].transpose(0, 1), k, v, seg.start, seg.order, call.scaling)
            if out is None:
                out = query.new_empty(query.shape[0], query.shape[1], attended.shape[-1])
            out[seg.rows] = attended.transpose(0, 1)
        return out
