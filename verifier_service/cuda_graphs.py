"""Passes replayed from CUDA graphs (vLLM's full CUDA graphs; --enforce-eager turns them off).

Why: on a GPU a pass through transformers' layers is about 1,300 kernel launches for a 30-layer model and the
Python around each. Measured on an H100 (SmolLM2-135M's shape, bf16, FlexAttention): 26-27 ms of host time a
pass in eager mode, 2.9 ms replayed from a graph at one sequence and 6.4 ms at 64
(docs/benchmarks/device/README.md).

How: a pass of T tokens runs as the graph of the smallest capture size >= T. Its metadata is padded to that
size (attention/flex.py's pass_fields: rows past T see nothing and write their KV to a scratch slot, tables are
as wide as the longest context allows) and copied into that graph's static input buffers; the graph builds the
FlexAttention block masks from them and runs the model, reading and writing the KV cache in place. So one
graph serves every mix of decodes, chains, trees and prompt chunks of its size, and the draft length needs no
capture size of its own (vllm-ascend asks for sizes that are multiples of k + 1 because its graphs are per
decode shape). The verifier captures every size at start, largest first (ModelRunner.capture_graphs; a size
not captured yet is captured on its first pass): two warm-up runs on a side stream, which compile FlexAttention
for the size, then the capture; again after the cache is reallocated. The graphs share one memory pool, and
their logits one buffer.

The capture itself is a parameter (`graph`), so the padding and the static buffers are tested on a CPU with
a "graph" that runs the same function again on replay.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verifier_service.attention.flex import PassShape, pass_fields
from verifier_service.batch import StepPlan, pass_layout

# vLLM's default capture sizes thinned: a pass pads to the next one, so at most 1.5x its tokens beyond 8.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

Forward = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor | None]]


def capture_sizes(spec: str, max_tokens: int) -> tuple[int, ...]:
    """--cuda-graph-sizes ("" for the defaults), up to the tokens a pass may hold."""
    sizes = sorted({int(size) for size in spec.split(",") if size.strip()}) if spec else DEFAULT_CAPTURE_SIZES
    return tuple(size for size in sizes if size <= max_tokens)


class CudaGraph:
    """torch.cuda.graph over a shared memory pool, the warm-up on a side stream as torch's documentation asks."""

    @staticmethod
    def new_pool():
        """A pool for a set of graphs: it is freed with its last graph, so dropped graphs' successors need a new one
        (capturing into a freed pool fails an allocator assertion, as seen on an H100)."""
        return torch.cuda.graph_pool_handle()

    def __init__(self, pool):
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, forward: Callable[[], tuple]) -> tuple:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles FlexAttention for this size; cuBLAS sets up its workspaces
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            outputs = forward()
        return outputs

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class Captured:
    inputs: dict[str, torch.Tensor]  # the static buffers a pass copies its own into
    outputs: tuple[torch.Tensor, torch.Tensor | None]
    graph: object


class PassGraphs:
    """The captured passes of one model over one cache."""

    def __init__(self, forward: Forward, sizes: tuple[int, ...], max_context_len: int, device: torch.device,
                 vocab_size: int, dtype: torch.dtype, graph: type = CudaGraph):
        """forward: runs the model over a pass's fields (padded, on the device), returning the logits of every row
        in the model's dtype; graph: what captures one."""
        self.forward, self.sizes, self.max_context_len, self.device = forward, sizes, max_context_len, device
        self.graph = graph
        # Every size's logits land in this one buffer: a graph's own outputs would stay in the pool as long as the
        # graph, for every size (1 GB in fp32 over the capture sizes for a 152k vocabulary).
        self.logits = torch.empty(max(sizes), vocab_size, dtype=dtype, device=device)
        self.pool = None
        self.block_size = self.width = self.scratch_slot = 0
        self.captured: dict[int, Captured] = {}

    def reset(self, block_size: int, scratch_slot: int) -> None:
        """A new cache; scratch_slot: where padding rows write."""
        self.drop()
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.width = -(-self.max_context_len // block_size)

    def drop(self) -> None:
        """Graphs captured over the old cache, or with other outputs, are captured again on their next pass."""
        self.captured.clear()
        self.pool = None

    def size_for(self, plan: StepPlan) -> int | None:
        """The capture size that runs this plan, or None (run it eagerly)."""
        size = next((size for size in self.sizes if size >= plan.num_tokens), None)
        if size is None or not self.width or any(-(-(seg.start + seg.num_tokens) // self.block_size) > self.width
                               for seg in plan.segments):
            return None
        return size

    def run(self, plan: StepPlan, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fp32 logits of the plan's logit rows, and its features (as ModelRunner.run returns them). A size's
        first pass captures its graph."""
        positions, offsets, rows = pass_layout(plan)
        fields = pass_fields(plan.segments, positions, offsets, self.block_size,
                             PassShape(size, size, self.width, size), self.scratch_slot)
        fields["input_ids"] = torch.tensor(list(plan.input_ids) + [0] * (size - plan.num_tokens))
        captured = self.captured.get(size)
        if captured is None:
            captured = self._capture(fields, size)
            self.captured[size] = captured
        for name, value in fields.items():
            captured.inputs[name].copy_(value, non_blocking=True)
        captured.graph.replay()
        features = captured.outputs[1]
        rows = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return (self.logits.index_select(0, rows).float(),
                None if features is None else features[:plan.num_tokens].clone())

    def _capture(self, fields: dict[str, torch.Tensor], size: int) -> Captured:
        inputs = {name: value.to(self.device) for name, value in fields.items()}
        if self.pool is None:
            self.pool = self.graph.new_pool()
        graph = self.graph(self.pool)

        def forward():
            logits, features = self.forward(inputs)
            self.logits[:size].copy_(logits)
            return self.logits[:size], features

        return Captured(inputs, graph.capture(forward), graph)
