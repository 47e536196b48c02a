"""Attention through FlexAttention (torch.nn.attention.flex_attention) over the
paged cache in place: CUDA's backend in waiting (--attention-backend
FLEX_ATTENTION), not its default until it has run on a GPU.

Why FlexAttention rather than FlashInfer: it ships with torch (no wheel per
CUDA and torch version to match), the same call runs on a CPU (so its masks
are tested here, on the hosts without a GPU) and a tree's visibility, a
sliding window, Gemma 2's softcapping and GPT-OSS's sinks are each a few lines
of mask or score function, where FlashInfer's paged kernels take a custom mask
only as a packed bit array per request and offer no sinks.

Each layer is one call over the whole pass: the pass's tokens are one packed
query sequence [1, heads, T, d], and the keys are the whole cache viewed as one
sequence of physical slots [1, kv_heads, slots, d], as vLLM's FlexAttention
backend lays them out. The block mask lists, for every 16 packed queries, the
cache blocks of the segments they belong to, so the kernel reads only those;
within them the mask function maps a physical slot back to the segment's
logical position (through the inverse of its block table) and decides what a
query sees: the keys cached before the pass, the pass's own tokens causally,
and in a draft tree only a node's ancestors. On CUDA the call is compiled
(FlexAttention's Triton kernel); elsewhere it runs in eager mode, which
computes every (query, slot) score and applies the same mask function: right,
and slow beyond small caches, so on a CPU it is for tests.

MLA's latent cache is refused (select_backend): its keys and values are
expanded from the latent rows per read, which a view of the whole cache cannot
do.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from verifier_service.attention.backend import LayerCall, slot_mapping
from verifier_service.attention.torch_sdpa import padded_group
from verifier_service.batch import PassInputs, Segment
from verifier_service.kv_cache import PagedKVCache
from verifier_service.tree import is_chain

QUERY_BLOCK = 16  # packed queries per row of the block mask (vLLM's default with torch >= 2.9)


@dataclass
class Metadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    block_size: int
    tables: torch.Tensor  # [segments, most blocks] each segment's blocks up to its context, -1 beyond
    segment: torch.Tensor  # [T] the segment of each pass row
    local_query: torch.Tensor  # [T] a row's index among its segment's new tokens
    positions: torch.Tensor  # [T]
    start: torch.Tensor  # [segments] tokens cached before the pass
    context: torch.Tensor  # [segments] start + new tokens
    first_row: torch.Tensor  # [segments]
    tree_row: torch.Tensor  # [T] the row of `tree_seen` a query follows (0: no tree)
    tree_seen: torch.Tensor  # [1 + tree queries, L] which of its segment's new tokens a tree query sees
    inverse_tables: torch.Tensor | None = None  # [segments, cache blocks] logical block of a physical one, or -1
    block_masks: dict[int | None, BlockMask] = field(default_factory=dict)  # by sliding window

    def block_mask(self, window: int | None, cache: PagedKVCache, compiled: bool) -> BlockMask:
        if window not in self.block_masks:
            if self.inverse_tables is None:
                self.inverse_tables = _inverse_tables(self.tables, cache.num_blocks)
            slots = cache.num_blocks * cache.block_size
            mask_mod = self.mask_mod(window)
            if not compiled:
                # Eager calls evaluate the mask function for every (query, slot) pair in every layer: evaluated
                # once per pass instead, each layer looks its answers up.
                seen = create_mask(mask_mod, 1, 1, self.num_tokens, slots, device=self.start.device)[0, 0]

                def mask_mod(b, h, q, kv):
                    return seen[q, kv]
            counts, indices = self._kv_blocks(window, cache.num_blocks)
            self.block_masks[window] = BlockMask.from_kv_blocks(
                counts[None, None], indices[None, None], BLOCK_SIZE=(QUERY_BLOCK, self.block_size),
                mask_mod=mask_mod, seq_lengths=(self.num_tokens, slots), compute_q_blocks=False)
        return self.block_masks[window]

    def _kv_blocks(self, window: int | None, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_num_blocks [query blocks] and kv_indices [query blocks, num_blocks] (as wide as the cache has
        blocks, as create_block_mask makes it; FlexAttention's CPU kernel asserts it): every cache block a
        segment with rows in a query block may read, each once (segments share prefix-cached blocks), under a
        window from the first block its queries reach. Built on the device, with no loop over blocks."""
        tables, device = self.tables, self.tables.device
        num_segments, widest = tables.shape
        rows = torch.arange(0, self.num_tokens, QUERY_BLOCK, device=device)
        first = self.segment[rows]  # a query block's segments are a run: its first row's to its last row's
        last = self.segment[(rows + QUERY_BLOCK - 1).clamp(max=self.num_tokens - 1)]
        ids = torch.arange(num_segments, device=device)
        member = (ids[None, :] >= first[:, None]) & (ids[None, :] <= last[:, None])  # [query blocks, segments]
        live = tables >= 0
        if window:  # a segment's earliest query is at position `start`: a window reaches back window - 1
            skip = (self.start - window + 1).clamp(min=0) // self.block_size
            live &= torch.arange(widest, device=device)[None, :] >= skip[:, None]
        # Each query block's blocks marked in a row of the cache's width (a dump column for what is not read).
        read = (member[:, :, None] & live[None]).view(len(rows), -1)
        columns = torch.where(read, tables.clamp(min=0).view(1, -1), num_blocks)
        used = torch.zeros(len(rows), num_blocks + 1, dtype=torch.bool, device=device)
        used.scatter_(1, columns, True)
        used = used[:, :num_blocks]
        # The marked blocks first, in block order: a stable sort of the marks.
        indices = torch.sort(used.to(torch.int8), dim=1, descending=True, stable=True).indices
        return used.sum(1, dtype=torch.int32), indices.to(torch.int32)

    def mask_mod(self, window: int | None) -> Callable:
        inverse, segment, local_query, positions = self.inverse_tables, self.segment, self.local_query, self.positions
        start, context, first_row, tree_row, tree_seen = (self.start, self.context, self.first_row, self.tree_row,
                                                          self.tree_seen)
        block_size = self.block_size
        # Bounds come from the tensors' shapes, not Python ints: a compiled kernel would be specialized (and
        # compiled again) for every pass's token count.

        def seen(b, h, q, kv):
            seg = segment[q]
            logical_block = inverse[seg, kv // block_size]
            logical = logical_block * block_size + kv % block_size
            local = logical - start[seg]  # < 0: cached before the pass
            new_seen = (local <= local_query[q]) & tree_seen[tree_row[q], local.clamp(0, tree_seen.shape[1] - 1)]
            visible = (logical_block >= 0) & (logical < context[seg]) & ((local < 0) | new_seen)
            if window:
                key_position = torch.where(local < 0, logical,
                                           positions[(first_row[seg] + local).clamp(0, positions.shape[0] - 1)])
                visible = visible & (positions[q] - key_position < window)
            return visible

        return seen


class FlexAttention:
    name = "flex-attention"
    split_kv = True

    def __init__(self, heads: int, kv_heads: int, compiled: bool):
        self.enable_gqa = heads != kv_heads
        self.compiled = compiled
        # fullgraph: a graph break would run the mask functions eagerly over every (query, slot) pair. A second
        # pass's other sizes recompile it once for dynamic shapes (sizes of 1 stay specialized: a few variants).
        self.flex_attention = torch.compile(flex_attention, fullgraph=True) if compiled else flex_attention

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        positions = inputs.positions[0]
        segment_rows = [i for i, seg in enumerate(segments) for _ in range(seg.num_tokens)]
        local = [r for seg in segments for r in range(seg.num_tokens)]
        trees = [(i, seg) for i, seg in enumerate(segments) if seg.parents and not is_chain(seg.parents)]
        widest = max((seg.num_tokens for _, seg in trees), default=1)
        tree_seen = [torch.ones(1, widest, dtype=torch.bool, device=device)]  # row 0: what is not a tree's
        tree_row = [0] * len(segment_rows)
        for i, seg in trees:
            offset, first = inputs.offsets[i], sum(len(rows) for rows in tree_seen)
            visible = padded_group([seg], [offset], positions, block_size, device).visible[0]
            tree_seen.append(F.pad(visible[:, seg.start:seg.start + seg.num_tokens], (0, widest - seg.num_tokens)))
            tree_row[offset:offset + seg.num_tokens] = range(first, first + seg.num_tokens)

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        used = [seg.block_table[:-(-(seg.start + seg.num_tokens) // block_size)] for seg in segments]
        widest_table = max(len(table) for table in used)
        return Metadata(
            slot_mapping(segments, block_size, device), len(segment_rows), block_size,
            tensor([list(table) + [-1] * (widest_table - len(table)) for table in used]),
            tensor(segment_rows), tensor(local), positions,
            tensor([seg.start for seg in segments]), tensor([seg.start + seg.num_tokens for seg in segments]),
            tensor(list(inputs.offsets)), tensor(tree_row), torch.cat(tree_seen))

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """query [T, heads, dim]; returns [T, heads, dim]."""
        keys, values = (c[call.layer].transpose(0, 1)[None] for c in (cache.keys, cache.values))
        sinks = call.sinks is not None
        out = self.flex_attention(
            query.transpose(0, 1)[None], keys, values, score_mod=_softcap(call.softcap),
            block_mask=metadata.block_mask(call.sliding_window, cache, self.compiled), scale=call.scaling,
            enable_gqa=self.enable_gqa, return_lse=sinks,
            kernel_options=self._kernel_options(query.device, cache.block_size))
        if sinks:
            # A sink is a key with a logit and no value: it only adds exp(sink) to each softmax's denominator,
            # which scales the output by sum / (sum + exp(sink)) = sigmoid(lse - sink).
            out, lse = out
            out = out * torch.sigmoid(lse - call.sinks.float()[None, :, None])[..., None].to(out.dtype)
        return out[0].transpose(0, 1)

    @staticmethod
    def _kernel_options(device: torch.device, block_size: int) -> dict | None:
        """The Triton kernel's tiles match the block mask's, as vLLM sets them (its decoding kernel would ask
        for larger key blocks than a cache block)."""
        if device.type != "cuda":
            return None
        return {"BLOCK_M": QUERY_BLOCK, "BLOCK_N": block_size, "FORCE_USE_FLEX_ATTENTION": True}


def _softcap(softcap: float | None) -> Callable | None:
    if not softcap:
        return None

    def capped(score, b, h, q, kv):
        return torch.tanh(score / softcap) * softcap

    return capped


def _inverse_tables(tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[segments, num_blocks]: the logical block each physical block holds for each segment, -1 where none."""
    num_segments, widest = tables.shape
    inverse = torch.full((num_segments, num_blocks + 1), -1, dtype=torch.long, device=tables.device)
    logical = torch.arange(widest, device=tables.device).expand(num_segments, -1)
    inverse.scatter_(1, torch.where(tables >= 0, tables, num_blocks), logical)  # padding into a dump column
    return inverse[:, :num_blocks]
