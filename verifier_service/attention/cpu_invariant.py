"""Batch-invariant attention on a CPU (--batch-invariant; on by default for
bf16): every segment of a pass, prompt chunks and draft trees included, in one
kernel call per layer that computes each query from its own query and the keys
and values it sees, in sequence order (csrc/invariant_attention.cc). Invariant
by construction, so no start-up check of the platform's operators is needed.

invariant.InvariantAttention computes the same property from torch operators
on any device, a dozen of them per segment and layer: on a CPU 0.13 ms a
decoding segment and layer, most of a 16-sequence bf16 pass (docs/benchmarks/
bf16). Like it, it refuses softcapping, sliding windows and sinks, with the
reason, at the start-up check's first pass; MLA's latent cache stays with it."""

from dataclasses import dataclass

import numpy as np
import torch

from verifier_service.attention.backend import LayerCall, slot_mapping, table_rows
from verifier_service.batch import PassInputs, Segment
from verifier_service.batch_invariant import UNSUPPORTED
from verifier_service.device import cpu_kernels
from verifier_service.kv_cache import PagedKVCache

DTYPES = (torch.float32, torch.bfloat16)


def attends(device: torch.device, dtype: torch.dtype, head_dim: int, latent: bool) -> bool:
    """Whether the kernel serves a model of this head dimension and dtype on `device` (latent: MLA's cache, whose
    keys and values are expanded per read; InvariantAttention serves it)."""
    if device.type != "cpu" or dtype not in DTYPES or latent:
        return False
    try:
        return cpu_kernels().attends_invariantly(head_dim)
    except ImportError:
        return False


@dataclass(frozen=True)
class Metadata:
    slot_mapping: torch.Tensor
    segments: torch.Tensor  # [n, 3] first row, new tokens, cached tokens
    tables: torch.Tensor  # [n, most blocks]
    previous: torch.Tensor  # [T] the new token (its index in its segment) a row's token follows; -1: none


def previous_tokens(segment: Segment) -> np.ndarray:
    """For each new token of `segment`, the one before it on its path: the pending tokens in a chain, a tree's
    roots after the last pending token, every other node after its parent."""
    pending, before = segment.num_pending, np.arange(segment.num_tokens) - 1
    if segment.parents:
        parents = np.asarray(segment.parents)
        before[pending:] = np.where(parents < 0, pending - 1, pending + parents)
    return before


class CpuInvariantAttention:
    name = "cpu-invariant"
    split_kv = False

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        starts = np.fromiter((seg.start for seg in segments), np.int64, len(segments))
        counts = np.fromiter((seg.num_tokens for seg in segments), np.int64, len(segments))
        used = -(-(starts + counts) // block_size)
        rows = np.stack([np.asarray(inputs.offsets, dtype=np.int64), counts, starts], axis=1)
        return Metadata(slot_mapping(segments, block_size, device), torch.from_numpy(rows),
                        torch.from_numpy(table_rows(segments, used, len(segments), int(used.max()), 0)),
                        torch.from_numpy(np.concatenate([previous_tokens(seg) for seg in segments])))

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        kv = cache.kv[call.layer]
        if call.sliding_window or call.softcap or call.sinks is not None:
            raise ValueError(UNSUPPORTED)
        query = query.contiguous()
        heads, kv_heads, head_dim = query.shape[1], kv.shape[1], cache.key_dim
        out = torch.empty_like(query)
        cpu_kernels().attend_invariant(query.data_ptr(), out.data_ptr(), kv.data_ptr(), metadata.tables.data_ptr(),
                                       metadata.segments.data_ptr(), metadata.previous.data_ptr(),
                                       len(metadata.segments), heads, kv_heads, head_dim, cache.block_size,
                                       metadata.tables.shape[1], call.scaling, kv.dtype == torch.bfloat16,
                                       torch.get_num_threads())
        return out
