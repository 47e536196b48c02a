"""Passes replayed from device graphs: CUDA graphs, and ACL graphs on an Ascend NPU (vLLM's full graphs;
--enforce-eager turns them off).

Why: on an accelerator a pass through transformers' layers is about 1,300 kernel launches for a 30-layer model and
the Python around each. Measured on an H100 (SmolLM2-135M's shape, bf16, FlexAttention): 26-27 ms of host time a
pass in eager mode, 2.9 ms replayed from a graph at one sequence and 6.4 ms at 64
(docs/benchmarks/device/README.md). An NPU launches its operators the same way.

How: a graph is captured per GraphSize, a pass of up to `tokens` tokens over up to `segments` segments, and a pass
runs as the smallest size that holds it. The attention backend lays the pass out for that size (`graph_inputs`:
padding rows see nothing that is kept and write their KV to a scratch slot, tables are as wide as the longest
context allows); the layout's tensors, with the rows whose logits are kept, go into the graph's static input buffers
in one copy (`StagedInputs`), and the graph runs the model over them, reading and writing the KV cache in place.
What a backend cannot read from a tensor is updated in the graph before each replay (`update_graph`: FIA's sequence
lengths, which it takes as host lists).
- FlexAttention (CUDA): a size is a token count; one graph serves every mix of decodes, chains, trees and prompt
  chunks of its size, since the graph builds the block masks from the copied tensors.
- Ascend's FIA: a size is `segments` causal segments of tokens / segments tokens each, a decode (1) or a chain of
  up to 16, as vllm-ascend captures decode shapes (token counts that are multiples of k + 1). Trees and longer
  prompt chunks run eagerly.
The verifier captures every size at start, largest first (ModelRunner.capture_graphs; a size not captured yet is
captured on its first pass): two warm-up runs on a side stream, then the capture; again after the cache is
reallocated. The graphs share one memory pool, and their logits one buffer.

The capture itself is a parameter (`graph`), so the layouts and the static buffers are tested on a CPU with a
"graph" that runs the same function again on replay.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from verifier_service.batch import Segment, StepPlan

# vLLM's default capture sizes thinned: a pass pads to the next one, so at most 1.5x its tokens beyond 8.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class GraphSize(NamedTuple):
    """What one graph runs: a pass of up to `tokens` tokens over up to `segments` segments."""

    tokens: int
    segments: int


@dataclass
class GraphInputs:
    """A pass laid out for a graph of some size (the backend's `graph_inputs`)."""

    fields: dict[str, torch.Tensor]  # on the host; copied into the graph's static buffers
    rows: list[int]  # the rows whose logits are kept, in segment order
    host: object = None  # what the backend's update_graph sets in the graph before a replay


# Runs the model over a size's static fields on the device (the backend's metadata built from them, the host values
# and, while a graph is captured, what the backend records in it), returning the logits of every row in the model's
# dtype and the head's features.
Forward = Callable[[dict[str, torch.Tensor], object, object], tuple[torch.Tensor, torch.Tensor | None]]


def capture_sizes(spec: str, max_tokens: int) -> tuple[int, ...]:
    """--cuda-graph-sizes ("" for the defaults), up to the tokens a pass may hold."""
    sizes = sorted({int(size) for size in spec.split(",") if size.strip()}) if spec else DEFAULT_CAPTURE_SIZES
    return tuple(size for size in sizes if size <= max_tokens)


class DeviceGraph:
    """A CUDA graph (`torch.cuda`), or an ACL graph (`torch.npu`, whose graph API is CUDA's under other names),
    over a shared memory pool, the warm-up on a side stream as torch's documentation asks."""

    def __init__(self, module, graph_class: type, pool):
        self.module, self.pool = module, pool
        self.graph = graph_class()

    @classmethod
    def for_device(cls, device: torch.device) -> Callable[[object], "DeviceGraph"]:
        """This device's graph class, bound: graph(pool)."""
        module = getattr(torch, device.type)  # torch.npu exists once torch_npu is imported (device.py)
        graph_class = module.NPUGraph if device.type == "npu" else module.CUDAGraph

        def graph(pool):
            return cls(module, graph_class, pool)

        graph.new_pool = module.graph_pool_handle  # freed with its last graph: dropped graphs' successors need a
        return graph  # new one (capturing into a freed pool fails an allocator assertion, as seen on an H100)

    def capture(self, forward: Callable[[], tuple], warm_up: Callable[[], tuple]) -> tuple:
        stream = self.module.Stream()
        stream.wait_stream(self.module.current_stream())
        with self.module.stream(stream):
            for _ in range(2):  # compiles FlexAttention and the layer operators for this size; BLAS its workspaces
                warm_up()
        self.module.current_stream().wait_stream(stream)
        with self.module.graph(self.graph, pool=self.pool):
            outputs = forward()
        return outputs

    def replay(self) -> None:
        self.graph.replay()


KEPT_ROWS = "kept_rows"  # staged with a pass's fields: the rows whose logits it returns, padded to the size


class StagedInputs:
    """A size's static inputs as views of one device buffer, which a pass fills from one host buffer of the same
    layout (pinned on CUDA) in one copy. Copied one by one, a pass's dozen small tensors cost a dozen copies'
    host time: 12 a step in the H200 profile of a Qwen3-8B decode (docs/benchmarks/device)."""

    def __init__(self, fields: dict[str, torch.Tensor], device: torch.device):
        layout, size = {}, 0
        for name, value in fields.items():
            layout[name] = (size, value.dtype, value.shape)
            size += -(-value.numel() * value.element_size() // 8) * 8  # each view 8-byte aligned
        self.device_bytes = torch.empty(size, dtype=torch.uint8, device=device)
        self.host_bytes = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.inputs = {name: _view(self.device_bytes, *at) for name, at in layout.items()}
        self._host = {name: _view(self.host_bytes, *at) for name, at in layout.items()}
        # A pinned buffer is copied from asynchronously: its next pass waits until the last one's copy is done.
        self._copied = torch.cuda.Event() if self.host_bytes.is_pinned() else None

    def load(self, fields: dict[str, torch.Tensor]) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        for name, value in fields.items():
            self._host[name].copy_(value)
        self.device_bytes.copy_(self.host_bytes, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    count = shape.numel() * dtype.itemsize
    return buffer[offset: offset + count].view(dtype).view(shape)


@dataclass
class Captured:
    staged: StagedInputs  # the static buffers a pass copies its own into
    outputs: tuple[torch.Tensor, torch.Tensor | None]
    graph: object
    tasks: object  # what the backend updates in this graph before a replay (None: nothing)


class PassGraphs:
    """The captured passes of one model over one cache."""

    def __init__(self, forward: Forward, backend, sizes: tuple[int, ...], max_context_len: int,
                 device: torch.device, vocab_size: int, dtype: torch.dtype, graph=None):
        """backend: the attention backend, which lays passes out for its graphs (attention/backend.py's
        GraphedBackend); sizes: --cuda-graph-sizes' token counts; graph: what captures one
        (DeviceGraph.for_device's)."""
        self.forward, self.backend, self.max_context_len, self.device = forward, backend, max_context_len, device
        self.sizes: tuple[GraphSize, ...] = tuple(backend.graph_sizes(sizes))
        self.graph = graph or DeviceGraph.for_device(device)
        # Every size's logits land in this one buffer: a graph's own outputs would stay in the pool as long as the
        # graph, for every size (1 GB in fp32 over the capture sizes for a 152k vocabulary).
        self.logits = torch.empty(max(size.tokens for size in self.sizes), vocab_size, dtype=dtype, device=device)
        self.pool = None
        self.block_size = self.width = self.scratch_slot = 0
        self.captured: dict[GraphSize, Captured] = {}

    def reset(self, block_size: int, scratch_slot: int) -> None:
        """A new cache; scratch_slot: where padding rows write (the first of a block of their own)."""
        self.drop()
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.width = -(-self.max_context_len // block_size)

    def drop(self) -> None:
        """Graphs captured over the old cache, or with other outputs, are captured again on their next pass."""
        self.captured.clear()
        self.pool = None

    def size_for(self, plan: StepPlan) -> GraphSize | None:
        """The size whose graph runs this plan, or None (run it eagerly)."""
        if not self.width:
            return None
        return self.backend.graph_size(plan, self.sizes, self.block_size, self.width)

    def warm_up_plan(self, size: GraphSize) -> StepPlan:
        """A pass of this size's shape over the cache's first block (capture_graphs runs one per size at start)."""
        per_segment = size.tokens // size.segments
        segment = Segment(tuple(range(-(-per_segment // self.block_size))), 0, per_segment)
        return StepPlan((), (0,) * size.tokens, (segment,) * size.segments)

    def run(self, plan: StepPlan, size: GraphSize) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the plan's logit rows in the model's dtype, and its features (as ModelRunner.run returns
        them). A size's first pass captures its graph."""
        laid_out = self.backend.graph_inputs(plan, size, self.block_size, self.width, self.scratch_slot)
        captured = self.captured.get(size)
        if captured is None:
            captured = self._capture(laid_out, size)
            self.captured[size] = captured
        else:
            captured.staged.load(_with_rows(laid_out, size))
        if captured.tasks is not None:
            # Before the replay: every step waits for the last pass's logits, so no replay of this graph is in
            # flight (vllm-ascend updates after launching the replay, where steps overlap).
            self.backend.update_graph(captured.tasks, laid_out.host)
        captured.graph.replay()
        features = captured.outputs[1]
        rows = captured.staged.inputs[KEPT_ROWS][:len(laid_out.rows)]
        return (self.logits.index_select(0, rows),
                None if features is None else features[:plan.num_tokens].clone())

    def _capture(self, laid_out: GraphInputs, size: GraphSize) -> Captured:
        fields = _with_rows(laid_out, size)
        staged = StagedInputs(fields, self.device)
        staged.load(fields)
        inputs = {name: staged.inputs[name] for name in laid_out.fields}
        if self.pool is None:
            self.pool = self.graph.new_pool()
        graph = self.graph(self.pool)
        tasks = self.backend.graph_tasks()

        def forward(recording=None):
            logits, features = self.forward(inputs, laid_out.host, recording)
            self.logits[:size.tokens].copy_(logits)
            return self.logits[:size.tokens], features

        return Captured(staged, graph.capture(lambda: forward(tasks), forward), graph, tasks)


def _with_rows(laid_out: GraphInputs, size: GraphSize) -> dict[str, torch.Tensor]:
    rows = torch.zeros(size.tokens, dtype=torch.long)
    rows[:len(laid_out.rows)] = torch.tensor(laid_out.rows, dtype=torch.long)
    return {**laid_out.fields, KEPT_ROWS: rows}
