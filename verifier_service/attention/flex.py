"""Attention through FlexAttention (torch.nn.attention.flex_attention) over the
paged cache in place: CUDA's default backend, whose passes replay from CUDA
graphs (graphs.py); --attention-backend FLEX_ATTENTION elsewhere.

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

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from verifier_service.attention.backend import LayerCall, new_token_slots, table_rows, within
from verifier_service.batch import PassInputs, Segment, StepPlan, pass_layout, segment_positions
from verifier_service.graphs import GraphInputs, GraphSize
from verifier_service.kv_cache import PagedKVCache
from verifier_service.tree import ancestor_mask, is_chain

QUERY_BLOCK = 16  # packed queries per row of the block mask (vLLM's default with torch >= 2.9)
MIN_KEY_SPAN = 16  # Triton's matrix instructions need tiles of 16 keys or more
RECOMPILE_LIMIT = 64  # compiled FlexAttention's variants in one process (FlexAttention.__init__ says which)


def key_span(block_size: int) -> int:
    """Cache slots per key block of the block mask and per kernel tile: a cache block, or several consecutive
    ones where blocks are shorter than a tile (the mask function hides the slots of other sequences there)."""
    return max(block_size, MIN_KEY_SPAN)


@dataclass(frozen=True)
class PassShape:
    """The sizes of a pass's metadata tensors: its own, or a captured graph's (graphs.py), padded."""

    tokens: int
    segments: int
    width: int  # blocks of the longest table
    tree_width: int  # new tokens of the widest draft tree (1: none)


@dataclass
class Metadata:
    slot_mapping: torch.Tensor
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

    @property
    def num_tokens(self) -> int:
        return self.segment.shape[0]

    def block_mask(self, window: int | None, cache: PagedKVCache, compiled: bool) -> BlockMask:
        if window not in self.block_masks:
            if self.inverse_tables is None:
                self.inverse_tables = _inverse_tables(self.tables, cache.num_blocks)
            slots, span = cache.num_blocks * cache.block_size, key_span(self.block_size)
            mask_mod = self.mask_mod(window)
            if not compiled:
                # Eager calls evaluate the mask function for every (query, slot) pair in every layer: evaluated
                # once per pass instead, each layer looks its answers up.
                seen = create_mask(mask_mod, 1, 1, self.num_tokens, slots, device=self.start.device)[0, 0]

                def mask_mod(b, h, q, kv):
                    return seen[q, kv]
            counts, indices = self._kv_blocks(window, -(-slots // span), span)
            self.block_masks[window] = BlockMask.from_kv_blocks(
                counts[None, None], indices[None, None], BLOCK_SIZE=(QUERY_BLOCK, span),
                mask_mod=mask_mod, seq_lengths=(self.num_tokens, slots), compute_q_blocks=False)
        return self.block_masks[window]

    def _kv_blocks(self, window: int | None, num_spans: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_num_blocks [query blocks] and kv_indices [query blocks, num_spans] (as wide as the cache has key
        spans, as create_block_mask makes it; FlexAttention's CPU kernel asserts it): every span holding a cache
        block that a segment with rows in a query block may read, each once (segments share prefix-cached
        blocks), under a window from the first block its queries reach. Tensor ops of fixed shapes on the device,
        with no loop and no host sync, so a CUDA graph captures them."""
        tables, device = self.tables, self.tables.device
        widest = tables.shape[1]
        query_blocks = -(-self.num_tokens // QUERY_BLOCK)
        rows = torch.arange(query_blocks * QUERY_BLOCK, device=device).clamp(max=self.num_tokens - 1)
        segments = self.segment[rows].view(query_blocks, QUERY_BLOCK)  # each row's segment, by query block
        blocks = tables[segments]  # [query blocks, 16, widest]
        live = blocks >= 0
        if window:  # a segment's earliest query is at position `start`: a window reaches back window - 1
            skip = (self.start - window + 1).clamp(min=0) // self.block_size
            live &= torch.arange(widest, device=device) >= skip[segments][..., None]
        # Each query block's blocks marked in a row of the cache's width (a dump column for what is not read).
        columns = torch.where(live, blocks * self.block_size // span, num_spans).view(query_blocks, -1)
        used = torch.zeros(query_blocks, num_spans + 1, dtype=torch.bool, device=device)
        used.scatter_(1, columns, True)
        used = used[:, :num_spans]
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
        # pass's other sizes recompile it once for dynamic shapes, but sizes of 1 stay specialized, each window
        # and softcap is a variant, and so is each model a process runs (bench device): more than dynamo's
        # default of 8 recompilations, after which fullgraph fails (seen on an H100).
        self.flex_attention = (torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)(
            torch.compile(flex_attention, fullgraph=True)) if compiled else flex_attention)

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        positions = [position for seg in segments for position in segment_positions(seg)]  # no device sync
        fields = pass_fields(segments, positions, inputs.offsets, block_size, own_shape(segments))
        return metadata(fields, block_size, device)

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

    # Its CUDA graphs (graphs.py): a size is a token count, any mix of segments within it.
    @staticmethod
    def graph_sizes(sizes: tuple[int, ...]) -> list[GraphSize]:
        return [GraphSize(size, size) for size in sizes]

    @staticmethod
    def graph_size(plan: StepPlan, sizes: tuple[GraphSize, ...], block_size: int, width: int) -> GraphSize | None:
        size = next((size for size in sizes if size.tokens >= plan.num_tokens), None)
        if size is None or any(-(-(seg.start + seg.num_tokens) // block_size) > width for seg in plan.segments):
            return None
        return size

    @staticmethod
    def graph_inputs(plan: StepPlan, size: GraphSize, block_size: int, width: int, scratch_slot: int) -> GraphInputs:
        positions, offsets, rows = pass_layout(plan)
        fields = pass_fields(plan.segments, positions, offsets, block_size,
                             PassShape(size.tokens, size.segments, width, size.tokens), scratch_slot)
        fields["input_ids"] = torch.tensor(list(plan.input_ids) + [0] * (size.tokens - plan.num_tokens))
        return GraphInputs(fields, rows)

    @staticmethod
    def graph_metadata(fields: dict[str, torch.Tensor], block_size: int, host: None, tasks: None) -> Metadata:
        return metadata(fields, block_size)

    @staticmethod
    def graph_tasks() -> None:
        return None  # the block masks are built in the graph from its buffers: nothing to update

    @staticmethod
    def _kernel_options(device: torch.device, block_size: int) -> dict | None:
        """The Triton kernel's tiles match the block mask's, as vLLM sets them (its decoding kernel would ask
        for larger key blocks than a cache block)."""
        if device.type != "cuda":
            return None
        return {"BLOCK_M": QUERY_BLOCK, "BLOCK_N": key_span(block_size), "FORCE_USE_FLEX_ATTENTION": True}


def own_shape(segments: tuple[Segment, ...]) -> PassShape:
    """A pass's metadata at its own sizes."""
    trees = [seg.num_tokens for seg in segments if seg.parents and not is_chain(seg.parents)]
    return PassShape(sum(seg.num_tokens for seg in segments), len(segments), 0, max(trees, default=1))


def pass_fields(segments: tuple[Segment, ...], positions: list[int], offsets: tuple[int, ...], block_size: int,
                shape: PassShape, scratch_slot: int = 0) -> dict[str, torch.Tensor]:
    """The metadata's tensors on the host, padded to `shape` (width 0: the longest table the pass reads). Rows
    past the pass's tokens belong to a segment with no blocks, see nothing, and write their KV to
    `scratch_slot`; segments past the pass's have no blocks."""
    count, num_segments = len(positions), len(segments)
    counts = np.fromiter((seg.num_tokens for seg in segments), np.int64, num_segments)
    starts = np.fromiter((seg.start for seg in segments), np.int64, num_segments)
    used = -(-(starts + counts) // block_size)  # the blocks each segment reads
    width = shape.width or int(used.max())
    tables = table_rows(segments, used, shape.segments, width, -1)
    tree_seen = torch.zeros(1 + shape.tokens, shape.tree_width, dtype=torch.bool)
    tree_seen[0] = True  # row 0: what is not a tree's
    tree_row = torch.zeros(shape.tokens, dtype=torch.long)
    row = 1
    for i, seg in enumerate(segments):
        if seg.parents and not is_chain(seg.parents):
            n, pending = seg.num_tokens, seg.num_pending
            seen = torch.ones(n, n, dtype=torch.bool).tril()
            seen[pending:, pending:] = ancestor_mask(seg.parents)
            tree_seen[row:row + n, :n] = seen
            tree_row[offsets[i]:offsets[i] + n] = torch.arange(row, row + n)
            row += n

    def column(values, size: int, pad: int) -> torch.Tensor:
        padded = np.full(size, pad, dtype=np.int64)
        padded[:len(values)] = values
        return torch.from_numpy(padded)

    return {
        "slot_mapping": column(new_token_slots(tables, starts, counts, block_size), shape.tokens, scratch_slot),
        "tables": torch.from_numpy(tables),
        "segment": column(np.repeat(np.arange(num_segments), counts), shape.tokens, num_segments),
        "local_query": column(within(counts), shape.tokens, 0),
        "positions": column(positions, shape.tokens, 0),
        "start": column(starts, shape.segments, 0),
        "context": column(starts + counts, shape.segments, 0),
        "first_row": column(offsets, shape.segments, count),
        "tree_row": tree_row,
        "tree_seen": tree_seen,
    }


def metadata(fields: dict[str, torch.Tensor], block_size: int, device: torch.device | None = None) -> Metadata:
    """The metadata over `fields` (moved to `device` first where given; a captured graph's are its own)."""
    if device is not None:
        fields = {name: value.to(device, non_blocking=True) for name, value in fields.items()}
    return Metadata(fields["slot_mapping"], block_size, fields["tables"], fields["segment"], fields["local_query"],
                    fields["positions"], fields["start"], fields["context"], fields["first_row"],
                    fields["tree_row"], fields["tree_seen"])


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
