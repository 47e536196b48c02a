"""The CPU's attention backend: decodes and chain verifies of up to
MAX_KERNEL_QUERIES tokens (3 with heads of 32 or fewer) through a kernel that
reads the keys and values in place through the block tables
(csrc/paged_attention.cc), everything else (prompt chunks, longer drafts,
trees) through torch_sdpa's padded calls.

Why the split: a decode step of 32 SmolLM2 sequences spent 58% of its time
in the padded path's block gather and SDPA call, a memory cost the in-place
kernel cuts to 0.30x (32 sequences of 300-517 tokens, one token each; 0.36x
with three, 0.70x with eight). One sequence verifying 3 to 6 tokens takes it
0.44-0.74x the padded path's time; from 12 tokens a segment, SDPA's blocked
products catch up (docs/benchmarks/verifier-engine).

The kernel computes each query's attention in a fixed order over its own
keys, whatever else the pass holds. It does fp32 only, causal chains with an
optional sliding window, for the head dimensions it was compiled for
(`_cpu_kernels.attends`: a model with others takes the padded path
throughout); a layer with softcapping, sinks or MLA's latent cache, another
dtype, or values of another width than its keys, takes the padded path for
every segment.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verifier_service.attention.backend import LayerCall, slot_mapping
from verifier_service.attention.torch_sdpa import Group, TorchAttention
from verifier_service.batch import PassInputs, Segment
from verifier_service.device import cpu_kernels
from verifier_service.kv_cache import PagedKVCache
from verifier_service.tree import is_chain

# Segments of at most this many new tokens take the kernel: at a head dimension of 64, at 8 it took 0.67-0.84x the
# padded path's time from 1 to 32 sequences; at 12, 0.77-1.03x, at 16 0.87-1.17x. Its per-query work weighs more
# against short heads: at 16 (the tiny test models'), 64 sequences of 3 tokens took it 0.58x, of 5 tokens 1.15x.
MAX_KERNEL_QUERIES = 8
MAX_KERNEL_QUERIES_SHORT_HEADS, SHORT_HEAD = 3, 32


def takes(segment: Segment, max_queries: int) -> bool:
    return segment.num_tokens <= max_queries and (not segment.parents or is_chain(segment.parents))


@dataclass
class Metadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    segments: torch.Tensor  # [n, 3] the kernel's segments: first row, new tokens, cached tokens
    tables: torch.Tensor  # [n, max blocks] their block tables
    groups: list[Group]  # the padded calls of the other segments
    # The padded calls of every segment, for a layer the kernel cannot attend: made at the first such layer.
    every_group: Callable[[], list[Group]]


class CpuPagedAttention:
    name = "cpu-paged"
    split_kv = False

    def __init__(self, heads: int, key_dim: int):
        self.padded = TorchAttention(heads * key_dim)
        # Decided once: a head dimension the kernel was not compiled for sends every segment to the padded path.
        longest = MAX_KERNEL_QUERIES if key_dim > SHORT_HEAD else MAX_KERNEL_QUERIES_SHORT_HEADS
        self.max_queries = longest if cpu_kernels().attends(key_dim, key_dim) else 0

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        mine = [i for i, seg in enumerate(segments) if takes(seg, self.max_queries)]
        rest = [i for i, seg in enumerate(segments) if not takes(seg, self.max_queries)]
        width = max((len(segments[i].block_table) for i in mine), default=0)
        tables = torch.tensor([list(segments[i].block_table) + [0] * (width - len(segments[i].block_table))
                               for i in mine], dtype=torch.int64).view(len(mine), width)
        rows = torch.tensor([(inputs.offsets[i], segments[i].num_tokens, segments[i].start) for i in mine],
                            dtype=torch.int64).view(len(mine), 3)
        groups = self.padded.groups(segments, rest, inputs, block_size, device) if rest else []
        every_group = functools.cache(functools.partial(self.padded.groups, segments, range(len(segments)), inputs,
                                                        block_size, device))
        return Metadata(slot_mapping(segments, block_size, device), inputs.positions.shape[1], rows, tables, groups,
                        every_group)

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        kv = cache.kv[call.layer]
        value_dim = kv.shape[2] - cache.key_dim
        if (call.softcap or call.sinks is not None or call.expand is not None or kv.dtype != torch.float32
                or value_dim != cache.key_dim):
            return self.padded.attend_groups(metadata.every_group(), call, query, cache, None)
        query = query.contiguous()
        heads, kv_heads = query.shape[1], kv.shape[1]
        out = query.new_empty(metadata.num_tokens, heads, value_dim)
        if len(metadata.segments):
            cpu_kernels().attend(query.data_ptr(), out.data_ptr(), kv.data_ptr(), metadata.tables.data_ptr(),
                                metadata.segments.data_ptr(), len(metadata.segments), heads, kv_heads,
                                cache.key_dim, value_dim, cache.block_size, metadata.tables.shape[1],
                                call.sliding_window or 0, call.scaling, torch.get_num_threads())
        return self.padded.attend_groups(metadata.groups, call, query, cache, out) if metadata.groups else out
