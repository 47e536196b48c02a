"""The RMSNorms that become one fused call (our CPU kernel; torch_npu's npu_rms_norm on an NPU) are those whose
forward computes what the call computes, and the CPU kernel gives transformers' values (EMULATION for the NPU:
tests/verifier/npu_emulation.py stands in for the operator)."""

import importlib
import re

import pytest
import torch

from verifier_service.npu_ops import NpuKernels
from verifier_service.rms_norm import LLAMA_FORM_NORMS, cpu_rms_norm, fuse_rms_norms

from . import npu_emulation

FUSED_CALLS = {"cpu-kernel": cpu_rms_norm, "npu-emulation": NpuKernels(npu_emulation).rms_norm}


def norm_class(name: str):
    family = re.sub(r"(?<!^)(?=[A-Z])", "_", name.removesuffix("RMSNorm")).lower()
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


@pytest.mark.parametrize("call", FUSED_CALLS)
@pytest.mark.parametrize("name", sorted(LLAMA_FORM_NORMS) + ["Gemma3RMSNorm", "Qwen3NextRMSNorm"])
def test_a_norm_is_fused_exactly_where_its_forward_is_the_fused_calls(name, call):
    norm = norm_class(name)(16, eps=1e-6)
    torch.nn.init.normal_(norm.weight, mean=0.5)
    x = torch.randn(3, 16)
    own = norm(x)
    model = torch.nn.Sequential(norm)
    assert fuse_rms_norms(model, FUSED_CALLS[call]) == (name in LLAMA_FORM_NORMS)
    if name in LLAMA_FORM_NORMS:
        assert torch.allclose(norm(x), own, atol=1e-6)
    else:  # a (1 + weight) norm: the fused call would compute something else
        assert not torch.allclose(FUSED_CALLS[call](x, norm.weight, 1e-6), own, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 70])  # 70: a tail past the last 16 values
def test_the_cpu_kernel_gives_transformers_values_row_by_row(dtype, hidden):
    norm = norm_class("LlamaRMSNorm")(hidden, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, mean=1.0)
    x = (torch.randn(2, 37, hidden) * 3).to(dtype)
    with torch.inference_mode():
        ours, theirs = cpu_rms_norm(x, norm.weight, 1e-5), norm(x)
        assert ours.shape == x.shape and ours.dtype == dtype
        if dtype == torch.bfloat16:  # the same roundings, so the same bits
            assert torch.equal(ours, theirs)
        else:
            assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)  # the sums in other orders: some ulps
        # A row alone is what it is in the batch, whatever the thread count (the row split).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(cpu_rms_norm(x[1, 5:6], norm.weight, 1e-5), ours[1, 5:6])
        finally:
            torch.set_num_threads(threads)


def test_the_cpu_kernel_leaves_mixed_dtypes_to_the_operators():
    norm = norm_class("LlamaRMSNorm")(32, eps=1e-6).bfloat16()
    torch.nn.init.normal_(norm.weight, mean=1.0)
    x = torch.randn(4, 32)  # fp32 activations, bf16 weight: not the kernel's case
    assert torch.equal(cpu_rms_norm(x, norm.weight, 1e-6), norm(x))
