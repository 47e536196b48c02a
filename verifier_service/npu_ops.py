"""torch_npu's fused operators in the model itself, on an Ascend NPU: each
RMSNorm of the Llama form (weight x x / rms(x)) becomes one `npu_rms_norm`
call instead of the five kernels transformers' forward launches, as
vllm-ascend does. The families listed are those whose norm has that form;
Gemma's and Qwen3-Next's scale by (1 + weight) and keep their own. Rotary
embeddings stay transformers' (a function inside each model's module, not a
layer to swap). Tested on a CPU against an emulation of the operator; not run
on an NPU yet."""

import functools
from collections.abc import Callable

import torch
from torch import nn

LLAMA_FORM_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
                              "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm", "Glm4MoeRMSNorm"})


def npu_rms_norm() -> Callable:
    import torch_npu  # only on an Ascend host: without CANN, importing it breaks torch

    return torch_npu.npu_rms_norm


def fuse_rms_norms(model: nn.Module, rms_norm: Callable) -> int:
    """Makes every Llama-form RMSNorm of `model` call `rms_norm(x, weight, epsilon)`; returns how many."""
    norms = [module for module in model.modules() if type(module).__name__ in LLAMA_FORM_NORMS]
    for norm in norms:
        norm.forward = functools.partial(_fused, norm, rms_norm)
    return len(norms)


def _fused(norm: nn.Module, rms_norm: Callable, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, norm.weight, epsilon=norm.variance_epsilon)[0]
