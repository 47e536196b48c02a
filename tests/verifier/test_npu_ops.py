"""The RMSNorms that become torch_npu's fused npu_rms_norm on an NPU are those whose forward
computes what it computes (EMULATION: tests/verifier/npu_emulation.py stands in for the operator)."""

import importlib
import re

import pytest
import torch

from verifier_service.npu_ops import LLAMA_FORM_NORMS, fuse_rms_norms

from .npu_emulation import npu_rms_norm


def norm_class(name: str):
    family = re.sub(r"(?<!^)(?=[A-Z])", "_", name.removesuffix("RMSNorm")).lower()
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


@pytest.mark.parametrize("name", sorted(LLAMA_FORM_NORMS) + ["Gemma3RMSNorm", "Qwen3NextRMSNorm"])
def test_a_norm_is_fused_exactly_where_its_forward_is_the_operators(name):
    norm = norm_class(name)(16, eps=1e-6)
    torch.nn.init.normal_(norm.weight, mean=0.5)
    x = torch.randn(3, 16)
    own = norm(x)
    model = torch.nn.Sequential(norm)
    assert fuse_rms_norms(model, npu_rms_norm) == (name in LLAMA_FORM_NORMS)
    if name in LLAMA_FORM_NORMS:
        assert torch.allclose(norm(x), own, atol=1e-6)
    else:  # a (1 + weight) norm: the operator would compute something else
        assert not torch.allclose(npu_rms_norm(x, norm.weight, epsilon=1e-6)[0], own, atol=1e-3)
