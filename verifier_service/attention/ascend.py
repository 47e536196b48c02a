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

ACL graphs (graphs.py) hold decodes and chains of up to 16 tokens a
segment, as vllm-ascend's full graphs hold decode shapes: a graph of S tokens
over S / q segments pads each segment's new tokens to q (1, 2, 4, 8 or 16).
FIA takes the sequence lengths as host lists, which a captured call keeps, so
each layer's call is captured as a task group (FiaTasks), and before each
replay the same call with the pass's lengths updates it from a side stream;
the graph's call waits for that update's event.

What the operator does not offer is refused at start (unsupported): Gemma 2's
score softcapping, GPT-OSS's sinks and MLA's latent cache. Tests run this
backend, its graphs included, on a CPU against a pure-torch emulation of the
operators' documented semantics (tests/verifier/npu_emulation.py); it has not
run on a real NPU.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from verifier_service.attention.backend import LayerCall, new_token_slots, slot_mapping, table_rows, within
from verifier_service.attention.torch_sdpa import padded_group
from verifier_service.batch import PassInputs, Segment, StepPlan
from verifier_service.graphs import GraphInputs, GraphSize
from verifier_service.kv_cache import PagedKVCache
from verifier_service.tree import is_chain

# The compressed causal mask of sparse modes 3 and 4: the operator reads its 2048 x 2048 upper triangle.
CAUSAL_MASK_SIZE = 2048
CAUSAL, BAND, EXPLICIT = 3, 4, 0  # sparse_mode
# New tokens a segment of an ACL graph holds: up to vllm-ascend's 16 tokens per sequence a round.
GRAPH_QUERY_LENGTHS = (1, 2, 4, 8, 16)


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
    tasks: "FiaTasks | None" = None  # while an ACL graph is captured: where its FIA calls are recorded


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


def _graph_ops() -> SimpleNamespace:
    """What an ACL graph's attention calls, from torch_npu and torch.npu (tests pass an emulation)."""
    import torch_npu

    npu = torch.npu
    return SimpleNamespace(
        fia_out=torch_npu.npu_fused_infer_attention_score.out,
        fia_workspace=torch_npu._npu_fused_infer_attention_score_get_max_workspace,
        current_stream=npu.current_stream, Stream=npu.Stream, stream=npu.stream, ExternalEvent=npu.ExternalEvent,
        graph_task_group_begin=npu.graph_task_group_begin, graph_task_group_end=npu.graph_task_group_end,
        graph_task_update_begin=npu.graph_task_update_begin, graph_task_update_end=npu.graph_task_update_end)


@dataclass
class _Task:
    handle: object
    event: object
    arguments: dict  # the FIA call's, as captured
    outputs: list[torch.Tensor]  # [attention out, softmax lse]
    workspace: torch.Tensor


class FiaTasks:
    """One ACL graph's FIA calls, captured as task groups that each replay's lengths update (vllm-ascend's full
    graph mode): the lengths are host lists, baked into a captured call."""

    def __init__(self, ops: SimpleNamespace):
        self.ops = ops
        self.update_stream = None
        self.tasks: dict[int, _Task] = {}  # by layer

    def capture(self, layer: int, arguments: dict) -> torch.Tensor:
        ops, query = self.ops, arguments["query"]
        stream = ops.current_stream()
        event = ops.ExternalEvent()
        event.wait(stream)  # a replay's call waits until update() has set its lengths
        event.reset(stream)
        workspace = ops.fia_workspace(**arguments)
        outputs = [torch.empty_like(query), query.new_empty(1)]
        ops.graph_task_group_begin(stream)
        ops.fia_out(**arguments, workspace=workspace, out=outputs)
        self.tasks[layer] = _Task(ops.graph_task_group_end(stream), event, arguments, outputs, workspace)
        return outputs[0]

    def update(self, query_ends: list[int], contexts: list[int]) -> None:
        ops = self.ops
        if self.update_stream is None:
            self.update_stream = ops.Stream()
        with ops.stream(self.update_stream):
            for task in self.tasks.values():
                ops.graph_task_update_begin(self.update_stream, task.handle)
                ops.fia_out(**{**task.arguments, "actual_seq_lengths": query_ends, "actual_seq_lengths_kv": contexts},
                            workspace=task.workspace, out=task.outputs)
                ops.graph_task_update_end(self.update_stream)
                task.event.record(self.update_stream)


class AscendAttention:
    name = "ascend-fia"
    split_kv = True

    def __init__(self, heads: int, kv_heads: int, fused_infer_attention_score: Callable | None = None,
                 graph_ops: SimpleNamespace | None = None):
        self.heads, self.kv_heads = heads, kv_heads
        self.fia = fused_infer_attention_score or _fused_infer_attention_score()
        self.graph_ops = graph_ops
        self._causal_mask: torch.Tensor | None = None

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        if self._causal_mask is None or self._causal_mask.device != device:
            ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
            self._causal_mask = torch.triu(ones, diagonal=1).to(torch.int8)
        return self._causal_mask

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
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
                        [seg.start + seg.num_tokens for seg, _ in causal], trees, self.causal_mask(device))

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """query [T, heads, dim]; returns [T, heads, dim]."""
        blocks = cache.num_blocks
        keys = cache.keys[call.layer].view(blocks, cache.block_size, -1)
        values = cache.values[call.layer].view(blocks, cache.block_size, -1)
        common = dict(num_heads=self.heads, num_key_value_heads=self.kv_heads, input_layout="TND",
                      scale=call.scaling, block_size=cache.block_size)
        window = _window(call)
        if metadata.tasks is not None:  # an ACL graph's capture (its passes have no trees)
            return metadata.tasks.capture(call.layer, dict(
                query=query, key=keys, value=values, block_table=metadata.block_table,
                actual_seq_lengths=metadata.query_ends, actual_seq_lengths_kv=metadata.contexts,
                atten_mask=metadata.causal_mask, sparse_mode=BAND if window else CAUSAL, **window, **common))

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


    # Its ACL graphs (graphs.py).
    @staticmethod
    def graph_sizes(sizes: tuple[int, ...]) -> list[GraphSize]:
        """Each token count S as S / q segments of q tokens, for every q that divides it."""
        return sorted({GraphSize(size, size // q) for size in sizes for q in GRAPH_QUERY_LENGTHS if size % q == 0})

    @staticmethod
    def graph_size(plan: StepPlan, sizes: tuple[GraphSize, ...], block_size: int, width: int) -> GraphSize | None:
        """The fewest tokens that hold the pass's segments at its longest segment's length; None for a pass with
        a tree or a segment longer than the graphs take."""
        segments = plan.segments
        if any(seg.parents and not is_chain(seg.parents) for seg in segments):
            return None
        longest = max(seg.num_tokens for seg in segments)
        for size in sizes:
            each = size.tokens // size.segments
            if (size.segments >= len(segments) and each >= longest
                    and all(-(-(seg.start + each) // block_size) <= width for seg in segments)):
                return size
        return None

    @staticmethod
    def graph_inputs(plan: StepPlan, size: GraphSize, block_size: int, width: int, scratch_slot: int) -> GraphInputs:
        """Segment i's tokens start at row i x q. Its padding rows follow its own tokens, write their KV to the
        scratch slot and are not kept: the causal mask aligned to the segment's last key (at start + q) shows
        each of its own tokens the keys it sees unpadded. Padding segments read the scratch block alone."""
        each, segments = size.tokens // size.segments, plan.segments
        n = len(segments)
        counts = np.fromiter((seg.num_tokens for seg in segments), np.int64, n)
        starts = np.fromiter((seg.start for seg in segments), np.int64, n)
        lengths = np.fromiter((min(len(seg.block_table), width) for seg in segments), np.int64, n)
        tables = table_rows(segments, lengths, size.segments, width, scratch_slot // block_size)
        first = np.arange(n) * each  # each segment's first row
        rows_fed = np.repeat(first, counts) + within(counts)
        input_ids = np.zeros(size.tokens, dtype=np.int64)
        input_ids[rows_fed] = plan.input_ids
        slots = np.full(size.tokens, scratch_slot, dtype=np.int64)
        slots[rows_fed] = new_token_slots(tables, starts, counts, block_size)
        # Padding rows repeat the last position: one past the model's longest would change a dynamic rotary.
        positions = np.zeros(size.tokens, dtype=np.int64)
        positions[:n * each] = (starts[:, None] + np.minimum(np.arange(each)[None, :], counts[:, None] - 1)).ravel()
        contexts = (starts + each).tolist() + [each] * (size.segments - n)
        kept = np.fromiter((seg.num_logit_rows for seg in segments), np.int64, n)
        last = first + np.fromiter((seg.num_pending for seg in segments), np.int64, n) - 1
        rows = np.repeat(last, kept) + within(kept)
        fields = {"input_ids": torch.from_numpy(input_ids), "positions": torch.from_numpy(positions),
                  "slot_mapping": torch.from_numpy(slots), "block_table": torch.from_numpy(tables.astype(np.int32))}
        return GraphInputs(fields, rows.tolist(), (list(range(each, size.tokens + 1, each)), contexts))

    def graph_metadata(self, fields: dict[str, torch.Tensor], block_size: int, host: tuple[list[int], list[int]],
                       tasks: FiaTasks | None) -> Metadata:
        query_ends, contexts = host
        return Metadata(fields["slot_mapping"], fields["input_ids"].shape[0], None, fields["block_table"], query_ends,
                        contexts, [], self.causal_mask(fields["input_ids"].device), tasks)

    def graph_tasks(self) -> FiaTasks:
        if self.graph_ops is None:
            self.graph_ops = _graph_ops()
        return FiaTasks(self.graph_ops)

    @staticmethod
    def update_graph(tasks: FiaTasks, host: tuple[list[int], list[int]]) -> None:
        tasks.update(*host)


def _window(call: LayerCall) -> dict[str, int]:
    """The band of a sliding window: a query sees the keys less than `sliding_window` positions before it."""
    return {"pre_tokens": call.sliding_window - 1, "next_tokens": 0} if call.sliding_window else {}


def _tree_call(seg: Segment, offset: int, positions: torch.Tensor, block_size: int, device: torch.device) -> TreeCall:
    group = padded_group([seg], [offset], positions, block_size, device)  # the visibility the padded path uses
    table = torch.tensor([seg.block_table], dtype=torch.int32, device=device)
    return TreeCall(slice(offset, offset + seg.num_tokens), table, seg.start + seg.num_tokens,
                    ~group.visible[:, None], group.query_positions[0], group.key_positions[0])
