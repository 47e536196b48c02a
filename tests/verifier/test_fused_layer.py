"""The fused Llama-form decoder layer (verifier_service/fused_layer.py): which layers take it, its kernels against
the operators of transformers' forward, and that forward still running on the fused weights (the start-up check's
reference). The architecture matrix (test_architectures.py) compares its passes with transformers' logits."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from verifier_service.device import cpu_kernels
from verifier_service.model_runner import ModelRunner

from .architectures import SERVED, save_tiny

FUSED_FAMILIES = {"llama", "qwen2", "qwen3", "mistral"}
PROMPT = [(7 * i) % 90 + 3 for i in range(13)]


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_the_llama_form_families_take_the_fused_layer_in_fp32(model_type, tmp_path):
    runner = ModelRunner(save_tiny(model_type, tmp_path), "cpu", torch.float32)
    layers = runner.model.config.get_text_config().num_hidden_layers
    assert runner.fused_layers == (layers if model_type in FUSED_FAMILIES else 0)


def test_bf16_keeps_transformers_layers(tmp_path):
    assert ModelRunner(save_tiny("llama", tmp_path), "cpu", torch.bfloat16).fused_layers == 0


def test_transformers_forward_runs_on_the_fused_weights_held_once(tmp_path):
    path = save_tiny("qwen2", tmp_path)  # biases on q, k and v
    runner = ModelRunner(path, "cpu", torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
    assert torch.allclose(runner.reference([PROMPT])[0], expected, atol=1e-5)
    names = [name for name, _ in runner.model.named_parameters()]
    assert not [name for name in names if name.endswith(("q_proj.weight", "k_proj.bias", "gate_proj.weight"))]
    assert sum(name.endswith("qkv_proj.bias") for name in names) == runner.fused_layers


def rotary(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[:, None].float() * inverse
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("rows, heads, kv_heads, dim", [(1, 9, 3, 64), (5, 4, 2, 8), (300, 8, 2, 16)])
def test_rope_store_rotates_the_queries_and_stores_the_rotated_keys_with_the_values(rows, heads, kv_heads, dim):
    """Queries and keys read in place from a fused q/k/v product's rows; 300 rows: the threaded path."""
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim + 3)[:, :-3]  # rows wider than the three parts
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    cos, sin = rotary(torch.arange(rows) + 40, dim)
    expected_q, expected_k = apply_rotary_pos_emb(q.reshape(1, rows, heads, dim).transpose(1, 2),
                                                  k.reshape(1, rows, kv_heads, dim).transpose(1, 2),
                                                  cos[None], sin[None])
    cache = torch.zeros(rows + 7, kv_heads, 2 * dim)
    slots = torch.randperm(rows + 7)[:rows]
    value = v.reshape(rows, kv_heads, dim).clone()
    cpu_kernels().rope_store(q.data_ptr(), q.stride(0), heads, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                             kv_heads, dim, cos.data_ptr(), sin.data_ptr(), cache.data_ptr(), slots.data_ptr(), rows,
                             2)
    assert torch.allclose(q.reshape(rows, heads, dim), expected_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(cache[slots, :, :dim], expected_k[0].transpose(0, 1), atol=1e-6)
    assert torch.equal(cache[slots, :, dim:], value)
    untouched = torch.ones(rows + 7, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].any()


@pytest.mark.parametrize("rows, width", [(1, 1536), (3, 70), (40, 1000)])  # 70: a tail; 40 x 1000: threaded
def test_silu_mul_is_swiglus_activation(rows, width):
    gate_up = torch.randn(rows, 2 * width) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = torch.empty(rows, width)
    cpu_kernels().silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width, 2)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, hidden", [(1, 576), (3, 70), (64, 576)])
def test_add_rms_norm_adds_the_residual_then_normalizes(rows, hidden):
    x, residual, weight = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.rand(hidden) + 0.5
    total = x + residual
    out = torch.empty(rows, hidden)
    cpu_kernels().add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, hidden,
                               1e-5, 2)
    assert torch.allclose(residual, total, atol=1e-6)
    expected = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(out, expected, atol=1e-5)
