"""RMSNorms of the Llama form (weight x x / rms(x)) through one fused call
instead of the seven operators transformers' forward launches: our CPU kernel
(csrc/rms_norm.cc) on a CPU, inductor's on CUDA (layer_kernels.py),
torch_npu's npu_rms_norm on an Ascend NPU (as vllm-ascend does; npu_ops.py).
The families listed are those whose norm has that form; Gemma's and
Qwen3-Next's scale by (1 + weight) and keep their own."""

import types
from collections.abc import Callable

import torch
from torch import nn

from verifier_service.device import cpu_kernels

LLAMA_FORM_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
                              "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm", "Glm4MoeRMSNorm"})

CPU_DTYPES = (torch.float32, torch.bfloat16)  # the kernel's


def fuse_rms_norms(model: nn.Module, rms_norm: Callable) -> int:
    """Makes every Llama-form RMSNorm of `model` return `rms_norm(x, weight, epsilon)`; returns how many."""
    norms = [module for module in model.modules() if type(module).__name__ in LLAMA_FORM_NORMS]
    for norm in norms:
        norm.fused_rms_norm = rms_norm
        # A bound method, as transformers gave it: wrappers such as compressed-tensors' offloading rebind forward.
        norm.forward = types.MethodType(_fused, norm)
    return len(norms)


def _fused(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return norm.fused_rms_norm(hidden_states, norm.weight, norm.variance_epsilon)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LlamaRMSNorm.forward's operators: the statistics in fp32, the product with the weight in x's dtype."""
    widened = x.float()
    widened = widened * torch.rsqrt(widened.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * widened.to(x.dtype)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """transformers' Llama RMSNorm of x's last dimension by our kernel where x and the weight are both fp32 or both
    bf16 (bf16: the same bits as transformers; fp32: within an ulp; each row's sum in one order), else by its
    operators."""
    if x.dtype != weight.dtype or x.dtype not in CPU_DTYPES:
        return llama_rms_norm(x, weight, epsilon)
    rows = x.contiguous()
    out = torch.empty_like(rows)
    cpu_kernels().rms_norm(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.numel() // rows.shape[-1],
                           rows.shape[-1], epsilon, x.dtype == torch.bfloat16, torch.get_num_threads())
    return out
