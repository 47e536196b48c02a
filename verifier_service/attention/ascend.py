"""Attention on an Ascend NPU: torch_npu's fused inference attention
(`npu_fused_infer_attention_score`, FIA) reading the paged cache through block
tables, called as vllm-ascend calls it.

One FIA call per layer attends every segment whose new tokens see each other
causally (decodes, chains, prompt chunks): `input_layout="TND"` with the
queries packed, `actual_seq_lengths` their cumulative ends,
`actual_seq_lengths_kv` each segment's context, and `sparse_mode=3`, the causal
mask aligned to each segment's last key, given as the 2048 x 2048 upper
triangle the operator asks for. A sliding window is `sparse_mode=4` with
`pre_tokens` the keys before the query that are still seen. A draft tree's
nodes see only their ancestors, which no causal mode says: each tree segment
has a call of its own with its explicit mask (`sparse_mode=0`, True where a
key is hidden). The cache must hold keys and values apart, each
[blocks, block_size, kv_heads x dim] (PagedKVCache(split=True)).

What the operator does not offer is refused at start (unsupported): Gemma 2's
score softcapping, GPT-OSS's sinks and MLA's latent cache. Tests run this
backend on a CPU against a pure-torch emulation of the operator's documented
semantics (tests/verifier/npu_emulation.py); it has not run on a real NPU.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verifier_service.attention.backend import LayerCall, slot_mapping
from verifier_service.attention.torch_sdpa import padded_group
from verifier_service.batch import PassInputs, Segment
from verifier_service.kv_cache import PagedKVCache
from verifier_service.tree import is_chain

# The compressed causal mask of sparse modes 3 and 4: the operator reads its 2048 x 2048 upper triangle.
CAUSAL_MASK_SIZE = 2048
CAUSAL, BAND, EXPLICIT = 3, 4, 0  # sparse_mode


@dataclass
class TreeCall:
    """A segment whose draft is a tree, attended in a call of its own."""

    rows: slice
    block_table: torch.Tensor  # [1, blocks] int32
    context: int
    hidden: torch.Tensor  # [1, 1, new tokens, context] bool, True where a key is hidden (before any window)
    query_positions: torch.Tensor  # [new tokens]
    key_positions: torch.Tensor  # [context]

    def mask(self, window: int | None) -> torch.Tensor:
        if not window:
            return self.hidden
        far = self.query_positions[:, None] - self.key_positions[None, :] >= window
        return self.hidden | far


@dataclass
class Metadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    rows: torch.Tensor | None  # the pass rows of the causal call where trees take others; None: all, in order
    block_table: torch.Tensor  # [segments, blocks] int32 of the causal call's segments
    query_ends: list[int]  # actual_seq_lengths: cumulative
    contexts: list[int]  # actual_seq_lengths_kv
    trees: list[TreeCall]
    causal_mask: torch.Tensor


def unsupported(text_config) -> str | None:
    """Why FIA cannot attend this model's layers as transformers does, in one line, or None."""
    name = getattr(text_config, "model_type", "this model")
    if getattr(text_config, "attn_logit_softcapping", None):
        return f"{name}: attention score softcapping has no Ascend attention kernel here; serve it on CPU or CUDA"
    if name == "gpt_oss":
        return f"{name}: attention sinks have no Ascend attention kernel here; serve it on CPU or CUDA"
    if getattr(text_config, "kv_lora_rank", None):
        return f"{name}: MLA's latent cache has no Ascend attention kernel here; serve it on CPU or CUDA"
    return None


def _fused_infer_attention_score() -> Callable:
    import torch_npu  # only on an Ascend host: without CANN, importing it breaks torch

    return torch_npu.npu_fused_infer_attention_score


class AscendAttention:
    name = "ascend-fia"
    split_kv = True

    def __init__(self, heads: int, kv_heads: int, fused_infer_attention_score: Callable | None = None):
        self.heads, self.kv_heads = heads, kv_heads
        self.fia = fused_infer_attention_score or _fused_infer_attention_score()
        self._causal_mask: torch.Tensor | None = None

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        if self._causal_mask is None or self._causal_mask.device != device:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            self._causal_mask = torch.triu(ones, diagonal=1).to(torch.int8)
        causal, trees = [], []
        for seg, offset in zip(segments, inputs.offsets):
            if seg.parents and not is_chain(seg.parents):
                trees.append(_tree_call(seg, offset, inputs.positions[0], block_size, device))
            else:
                causal.append((seg, offset))
        width = max((len(seg.block_table) for seg, _ in causal), default=0)
        table = torch.tensor([list(seg.block_table) + [0] * (width - len(seg.block_table)) for seg, _ in causal],
                             dtype=torch.int32, device=device).view(len(causal), width)
        rows = (torch.tensor([r for seg, offset in causal for r in range(offset, offset + seg.num_tokens)],
                             dtype=torch.long, device=device) if trees else None)
        return Metadata(slot_mapping(segments, block_size, device), inputs.positions.shape[1], rows, table,
                        list(itertools.accumulate(seg.num_tokens for seg, _ in causal)),
                        [seg.start + seg.num_tokens for seg, _ in causal], trees, self._causal_mask)

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """query [T, heads, dim]; returns [T, heads, dim]."""
        blocks = cache.num_blocks
        keys = cache.keys[call.layer].view(blocks, cache.block_size, -1)
        values = cache.values[call.layer].view(blocks, cache.block_size, -1)
        common = dict(num_heads=self.heads, num_key_value_heads=self.kv_heads, input_layout="TND",
                      scale=call.scaling, block_size=cache.block_size)
        window = _window(call)

        def causal(q: torch.Tensor) -> torch.Tensor:
            return self.fia(q, keys, values, block_table=metadata.block_table, actual_seq_lengths=metadata.query_ends,
                            actual_seq_lengths_kv=metadata.contexts, atten_mask=metadata.causal_mask,
                            sparse_mode=BAND if window else CAUSAL, **window, **common)[0]

        if not metadata.trees:  # one call attends every row of the pass, in order
            return causal(query)
        out = query.new_empty(query.shape)
        if metadata.query_ends:
            out[metadata.rows] = causal(query.index_select(0, metadata.rows))
        for tree in metadata.trees:
            attended, _ = self.fia(query[tree.rows], keys, values, block_table=tree.block_table,
                                   actual_seq_lengths=[tree.rows.stop - tree.rows.start],
                                   actual_seq_lengths_kv=[tree.context], atten_mask=tree.mask(call.sliding_window),
                                   sparse_mode=EXPLICIT, **common)
            out[tree.rows] = attended
        return out


def _window(call: LayerCall) -> dict[str, int]:
    """The band of a sliding window: a query sees the keys less than `sliding_window` positions before it."""
    return {"pre_tokens": call.sliding_window - 1, "next_tokens": 0} if call.sliding_window else {}


def _tree_call(seg: Segment, offset: int, positions: torch.Tensor, block_size: int, device: torch.device) -> TreeCall:
    group = padded_group([seg], [offset], positions, block_size, device)  # the visibility the padded path uses
    table = torch.tensor([seg.block_table], dtype=torch.int32, device=device)
    return TreeCall(slice(offset, offset + seg.num_tokens), table, seg.start + seg.num_tokens,
                    ~group.visible[:, None], group.query_positions[0], group.key_positions[0])
