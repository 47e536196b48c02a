"""The operators of a fused Llama-form layer (fused_layer.py), one class per
kind of device:

- CpuKernels: our C++ kernels (csrc/fused_layer.cc, csrc/rms_norm.cc), one
  row at a time, rounding in bf16 where transformers' operators round.
- NpuKernels (npu_ops.py): torch_npu's fused operators, as vllm-ascend calls
  them.
- TorchKernels: the same operators written as transformers' own operator
  sequences. On CUDA they are compiled (torch.compile, inductor): each becomes
  a few Triton kernels in place of the 7-20 that transformers' eager forward
  launches, and the CUDA graphs (graphs.py) replay them as they are.

Why on CUDA: replayed from graphs, a Qwen3-8B-shaped decode step on an H100
spent 9.6 ms of device time against 5.5 ms of weight reads
(docs/benchmarks/device/README.md). The rest is small kernels of 2-5 us: a
norm is seven, a rotary embedding six per tensor, a SwiGLU activation two, 41
a layer besides the products (docs/benchmarks/device/layer_operators.py);
fused, 2.2 besides the products and these four compiled functions. Compiled
with `emulate_precision_casts`, a fused kernel rounds to the model's dtype
where the eager operators would, so it keeps their values.
"""

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from verifier_service.device import cpu_kernels
from verifier_service.kv_cache import PagedKVCache
from verifier_service.rms_norm import CPU_DTYPES, cpu_rms_norm, llama_rms_norm

RECOMPILE_LIMIT = 64  # each model's shapes and epsilon are a variant, and a process may run several (bench device)


class LayerKernels(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        """transformers' Llama RMSNorm of x's last dimension."""
        ...

    def attention_inputs(self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, qk_norm: tuple | None,
                         cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache, layer: int,
                         slots: torch.Tensor) -> torch.Tensor:
        """From a fused q/k/v product's rows [T, (heads + 2 kv_heads) dim]: each head's query and key normalized
        where the layer does (qk_norm: the q and k norms' weights and their epsilon), rotated by cos, sin [T, dim];
        the keys and values stored into `layer`'s cache at `slots`. Returns the queries [T, heads, dim]."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its RMSNorm) as transformers' layer computes them, rounded alike."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation of a fused gate/up product's rows [T, 2 width]: silu(gate) x up, [T, width]."""
        ...


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return total, llama_rms_norm(total, weight, epsilon)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb's operators on x [T, heads, dim] (rotate_half: the halves swapped, the second
    negated)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


def rotated_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, qk_norm: tuple | None, cos: torch.Tensor,
                sin: torch.Tensor, norm: Callable = llama_rms_norm,
                rotation: Callable = rotate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries and keys normalized (qk_norm) and rotated, and the values: [T, heads or kv_heads, dim]; `norm`
    and `rotation` are transformers' operators unless a device's are given."""
    rows = qkv.shape[0]
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = q.reshape(rows, heads, dim), k.reshape(rows, kv_heads, dim), v.reshape(rows, kv_heads, dim)
    if qk_norm is not None:
        q_weight, k_weight, epsilon = qk_norm
        q, k = norm(q, q_weight, epsilon), norm(k, k_weight, epsilon)
    return rotation(q, cos, sin), rotation(k, cos, sin), v


class TorchKernels:
    """The operators as torch's, compiled by inductor where `compiled` (CUDA); eager they are transformers' own
    operator sequences, value for value."""

    def __init__(self, compiled: bool):
        def compile_(function):
            if not compiled:
                return function
            return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)(
                torch.compile(function, fullgraph=True, options={"emulate_precision_casts": True}))

        self.compiled = compiled
        self.rms_norm, self.add_rms_norm, self.silu_mul = map(compile_, (llama_rms_norm, add_rms_norm, silu_mul))
        self._rotated_qkv = compile_(rotated_qkv)

    def attention_inputs(self, qkv, heads, kv_heads, dim, qk_norm, cos, sin, cache, layer, slots):
        q, k, v = self._rotated_qkv(qkv, heads, kv_heads, dim, qk_norm, cos, sin)
        # Outside the compiled function: a store into a graph input may become a copy of the whole cache.
        cache.write(layer, slots, k, v)
        return q


class CpuKernels:
    """Our C++ kernels; a cache kept in split key and value tensors (FlexAttention's on a CPU, for tests) takes
    TorchKernels' store."""

    def __init__(self):
        self.kernels = cpu_kernels()
        self.eager = TorchKernels(compiled=False)

    rms_norm = staticmethod(cpu_rms_norm)

    def attention_inputs(self, qkv, heads, kv_heads, dim, qk_norm, cos, sin, cache, layer, slots):
        if cache.kv is None:
            return self.eager.attention_inputs(qkv, heads, kv_heads, dim, qk_norm, cos, sin, cache, layer, slots)
        rows = qkv.shape[0]
        q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
        if qk_norm is not None:
            q_weight, k_weight, epsilon = qk_norm
            q = self.rms_norm(q.reshape(rows, heads, dim), q_weight, epsilon).view(rows, -1)
            k = self.rms_norm(k.reshape(rows, kv_heads, dim), k_weight, epsilon).view(rows, -1)
        cos, sin = cos.contiguous(), sin.contiguous()
        self.kernels.rope_store(q.data_ptr(), q.stride(0), heads, k.data_ptr(), k.stride(0), v.data_ptr(),
                                v.stride(0), kv_heads, dim, cos.data_ptr(), sin.data_ptr(),
                                cache.kv[layer].data_ptr(), slots.data_ptr(), rows, qkv.dtype == torch.bfloat16,
                                torch.get_num_threads())
        return q.view(rows, heads, dim)

    def add_rms_norm(self, x, residual, weight, epsilon):
        x, residual = x.contiguous(), residual.contiguous()
        normed = torch.empty_like(residual)
        self.kernels.add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), normed.data_ptr(),
                                  residual.shape[0], residual.shape[1], epsilon, x.dtype == torch.bfloat16,
                                  torch.get_num_threads())
        return residual, normed

    def silu_mul(self, gate_up):
        gate_up = gate_up.contiguous()
        activated = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.kernels.silu_mul(gate_up.data_ptr(), activated.data_ptr(), gate_up.shape[0], activated.shape[1],
                              gate_up.dtype == torch.bfloat16, torch.get_num_threads())
        return activated


def device_kernels(device: torch.device, dtype: torch.dtype) -> LayerKernels | None:
    """The layer operators on this device: ours on a CPU in fp32 or bf16, inductor's on CUDA, torch_npu's on an
    NPU; None elsewhere."""
    if device.type == "cuda":
        return TorchKernels(compiled=True)
    if device.type == "npu":
        from verifier_service.npu_ops import NpuKernels  # built on this module's functions

        return NpuKernels()
    if device.type == "cpu" and dtype in CPU_DTYPES:
        return CpuKernels()
    return None
