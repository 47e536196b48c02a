"""Attention over the paged KV cache, plugged into the Hugging Face model
through `AttentionInterface`: the model keeps its own weights, projections
and rotary embeddings, and calls `paged_attention` instead of its attention.

The model runs without a transformers cache and with no mask function
registered for this implementation, so transformers builds no mask; which
keys each query sees comes from the pass's metadata, built once per pass by
the device's backend (backend.py). Each device's backend:

- CPU, fp32: cpu_paged.CpuPagedAttention, a kernel reading the blocks in place
  for decodes and short chains, torch_sdpa's padded calls for the rest.
- Ascend: ascend.AscendAttention, torch_npu's fused inference attention
  over the block tables (tested on a CPU against an emulation of the operator).
- Other dtypes on a CPU, and CUDA: torch_sdpa.TorchAttention, padded SDPA
  calls per layer (segments of similar lengths in one).
- --batch-invariant: on a CPU, cpu_invariant.CpuInvariantAttention, a kernel
  whose queries are computed from their own keys alone; elsewhere
  invariant.InvariantAttention, the same property from torch operators.

--attention-backend names one instead (vLLM's flag and names): TORCH_SDPA,
or FLEX_ATTENTION, flex.FlexAttention, one FlexAttention call per layer over
the cache in place, compiled on CUDA. It is CUDA's default (chosen_backend)
because its passes are captured as CUDA graphs (graphs.py).
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from verifier_service.attention import cpu_invariant
from verifier_service.attention.ascend import AscendAttention
from verifier_service.attention.backend import AttentionBackend, LayerCall
from verifier_service.attention.cpu_paged import CpuPagedAttention
from verifier_service.attention.flex import FlexAttention
from verifier_service.attention.invariant import InvariantAttention
from verifier_service.attention.torch_sdpa import TorchAttention
from verifier_service.config import FLEX_ATTENTION, TORCH_SDPA
from verifier_service.kv_cache import PagedKVCache
from verifier_service.linear_attention import LinearLayout, LinearStates

ATTENTION_NAME = "speclane_paged"


@dataclass(frozen=True)
class PassContext:
    """What every layer of one pass needs (transformers hands it to the attention function)."""

    cache: PagedKVCache
    backend: AttentionBackend
    metadata: object
    # Models with linear attention: the sequences' recurrent states and this pass's layout over them.
    states: LinearStates | None = None
    linear: LinearLayout | None = None


# FlexAttention's Triton kernels multiply with matrix instructions that need at least 16 along the head dimension.
MIN_FLEX_HEAD_DIM = 16


def chosen_backend(choice: str, device_type: str, latent: bool, batch_invariant: str, head_dim: int) -> str:
    """--attention-backend as the engine takes it: auto on CUDA is FLEX_ATTENTION, whose passes replay from CUDA
    graphs (9x faster on an H100 than eager ones), unless invariant passes are asked for (--batch-invariant on:
    a call per segment), the cache is MLA's latent, which FlexAttention cannot read, or heads are too narrow."""
    if (choice == "auto" and device_type == "cuda" and not latent and batch_invariant != "on"
            and head_dim >= MIN_FLEX_HEAD_DIM):
        return FLEX_ATTENTION
    return choice


def select_backend(device: torch.device, dtype: torch.dtype, batch_invariant: bool, heads: int, kv_heads: int,
                   key_dim: int, latent: bool = False, choice: str = "auto") -> AttentionBackend:
    """heads, kv_heads: a layer's query and key-value heads (on this rank); key_dim: its head dimension;
    latent: MLA's latent cache; choice: --attention-backend. Raises ValueError for a choice that cannot serve."""
    if choice == FLEX_ATTENTION:
        if latent or device.type == "npu":
            raise ValueError(f"--attention-backend {FLEX_ATTENTION} cannot attend "
                             + ("MLA's latent cache" if latent else "on an NPU") + "; use auto")
        if device.type == "cuda" and key_dim < MIN_FLEX_HEAD_DIM:
            raise ValueError(f"--attention-backend {FLEX_ATTENTION} needs heads of at least {MIN_FLEX_HEAD_DIM} "
                             f"dimensions on CUDA, this model's have {key_dim}; use auto")
        return FlexAttention(heads, kv_heads, compiled=device.type == "cuda")
    if choice == TORCH_SDPA:
        return TorchAttention(heads * key_dim)
    if batch_invariant:
        return (cpu_invariant.CpuInvariantAttention() if cpu_invariant.attends(device, dtype, key_dim, latent)
                else InvariantAttention())
    if device.type == "npu":
        return AscendAttention(heads, kv_heads)
    if device.type == "cpu" and dtype == torch.float32:
        return CpuPagedAttention(heads, key_dim)
    return TorchAttention(heads * key_dim)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    softcap=None, s_aux=None, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] for the packed new
    tokens; writes their KV to the cache, then attends; returns [1, T, heads, d_v]."""
    context: PassContext = kwargs["speclane_pass"]
    context.cache.write(module.layer_idx, context.metadata.slot_mapping, key[0].transpose(0, 1),
                        value[0].transpose(0, 1))
    call = layer_call(module, scaling if scaling is not None else query.shape[-1] ** -0.5, sliding_window, softcap,
                      s_aux)
    return context.backend.attend(context.metadata, call, query[0].transpose(0, 1), context.cache)[None], None


def layer_call(module, scaling: float, sliding_window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> LayerCall:
    """What attention `module` (a layer's, as transformers built it) adds to the pass's metadata."""
    return LayerCall(module.layer_idx, scaling, sliding_window, softcap, sinks,
                     getattr(module, "speclane_expand", None))


def register() -> str:
    """Registers the implementation with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
