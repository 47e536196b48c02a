"""The fused Llama-form decoder layer (verifier_service/fused_layer.py): which layers take it, its kernels against
the operators of transformers' forward, and that forward still running on the fused weights (the start-up check's
reference). The architecture matrix (test_architectures.py) compares its passes with transformers' logits."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from verifier_service import model_runner
from verifier_service.amx_linear import amx_ready
from verifier_service.batch import Segment, StepPlan
from verifier_service.block_manager import BlockManager, BlockTable
from verifier_service.device import cpu_kernels
from verifier_service.fused_layer import fuses_layers
from verifier_service.layer_kernels import CpuKernels, TorchKernels, device_kernels
from verifier_service.model_runner import ModelRunner
from verifier_service.npu_ops import NpuKernels
from verifier_service.self_check import tolerance

from . import npu_emulation
from .architectures import SERVED, save_tiny

FUSED_FAMILIES = {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe"}
PROMPT = [(7 * i) % 90 + 3 for i in range(13)]


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_the_llama_form_families_take_the_fused_layer_in_fp32(model_type, tmp_path):
    runner = ModelRunner(save_tiny(model_type, tmp_path), "cpu", torch.float32)
    layers = runner.model.config.get_text_config().num_hidden_layers
    assert runner.fused_layers == (layers if model_type in FUSED_FAMILIES else 0)


@pytest.mark.skipif(amx_ready(), reason="AMX CPUs keep transformers' bf16 layers (fused_layer.fuses_layers)")
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma2"])
def test_bf16_takes_the_fused_layer_too(model_type, tmp_path):
    runner = ModelRunner(save_tiny(model_type, tmp_path), "cpu", torch.bfloat16)
    layers = runner.model.config.get_text_config().num_hidden_layers
    assert runner.fused_layers == (layers if model_type in FUSED_FAMILIES else 0)


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


DTYPES = [torch.float32, torch.bfloat16]


def same(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> bool:
    """fp32: within atol; bf16: the same bits, as transformers' bf16 operators round."""
    return torch.equal(actual, expected) if actual.dtype == torch.bfloat16 else torch.allclose(actual, expected,
                                                                                               atol=atol)


# Head dims of 64 and 128: whole vectors of 16; 8 and 40: a scalar tail.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads, kv_heads, dim", [(1, 9, 3, 64), (5, 4, 2, 8), (3, 2, 1, 40), (2, 4, 2, 128),
                                                        (300, 8, 2, 16)])
def test_rope_store_rotates_the_queries_and_stores_the_rotated_keys_with_the_values(rows, heads, kv_heads, dim,
                                                                                     dtype):
    """Queries and keys read in place from a fused q/k/v product's rows; 300 rows: the threaded path."""
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim + 3) * 4).to(dtype)[:, :-3]  # rows wider than the parts
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    cos, sin = (part.to(dtype) for part in rotary(torch.arange(rows) + 40, dim))  # as the rotary module casts them
    expected_q, expected_k = apply_rotary_pos_emb(q.reshape(1, rows, heads, dim).transpose(1, 2),
                                                  k.reshape(1, rows, kv_heads, dim).transpose(1, 2),
                                                  cos[None], sin[None])
    cache = torch.zeros(rows + 7, kv_heads, 2 * dim, dtype=dtype)
    slots = torch.randperm(rows + 7)[:rows]
    value = v.reshape(rows, kv_heads, dim).clone()
    cpu_kernels().rope_store(q.data_ptr(), q.stride(0), heads, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                             kv_heads, dim, cos.data_ptr(), sin.data_ptr(), cache.data_ptr(), slots.data_ptr(), rows,
                             dtype == torch.bfloat16, 2)
    assert same(q.reshape(rows, heads, dim), expected_q[0].transpose(0, 1), atol=1e-5)
    assert same(cache[slots, :, :dim], expected_k[0].transpose(0, 1), atol=1e-5)
    assert torch.equal(cache[slots, :, dim:], value)
    untouched = torch.ones(rows + 7, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 1536), (3, 70), (40, 1000)])  # 70: a tail; 40 x 1000: threaded
def test_silu_mul_is_swiglus_activation(rows, width, dtype):
    gate_up = (torch.randn(rows, 2 * width) * 8).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = torch.empty(rows, width, dtype=dtype)
    cpu_kernels().silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width, dtype == torch.bfloat16, 2)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    if dtype == torch.float32:
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    else:  # our sigmoid is within an fp32 ulp or two of PyTorch's: a bf16 rounding rarely differs, by one step
        assert torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-30)  # silu(-100): e^-87 floors
        assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (3, 70), (64, 576)])
def test_add_rms_norm_adds_the_residual_then_normalizes(rows, hidden, dtype):
    x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = (torch.rand(hidden) + 0.5).to(dtype)
    total = x + residual  # rounded to the dtype, as transformers' residual add is
    out = torch.empty(rows, hidden, dtype=dtype)
    cpu_kernels().add_rms_norm(x.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), rows,
                               hidden, 1e-5, dtype == torch.bfloat16, 2)
    assert same(residual, total, atol=1e-6)
    with torch.no_grad():
        assert same(out, norm(total), atol=1e-5)


# The layer operators of each device that this host can run: ours, and CUDA's (inductor's code, compiled here for the
# CPU: the same functions and fusions, C++ where CUDA gets Triton), and the same operators uncompiled.
KERNELS = {"cpu": CpuKernels, "torch": lambda: TorchKernels(compiled=False),
           "inductor": lambda: TorchKernels(compiled=True), "npu-emulation": lambda: NpuKernels(npu_emulation)}
INDUCTOR = pytest.param("inductor", marks=pytest.mark.e2e)  # it runs the C++ compiler


def passes(path, dtype: torch.dtype, kernels: str | None) -> torch.Tensor:
    """A prefill's and a chain verify's logits, the layers fused over `kernels` (None: transformers' layers)."""
    if kernels is None:
        runner = ModelRunner(path, "cpu", dtype, fuse=False)
    else:
        made = KERNELS[kernels]()
        with mock.patch.object(model_runner, "device_kernels", lambda *a: made):
            runner = ModelRunner(path, "cpu", dtype)
    assert bool(runner.fused_layers) == bool(kernels)
    runner.allocate_cache(16, 4)
    table = BlockTable()
    assert BlockManager(16, 4, False).allocate(table, [], 30) == 0
    blocks = tuple(table.blocks)
    prompt, _ = runner.execute(StepPlan((), tuple(PROMPT[:-1]), (Segment(blocks, 0, len(PROMPT) - 1, ()),)))
    chain, _ = runner.execute(StepPlan((), (PROMPT[-1], 5, 6, 7), (Segment(blocks, len(PROMPT) - 1, 1, (-1, 0, 1)),)))
    return torch.cat([prompt, chain])


@pytest.mark.skipif(amx_ready(), reason="AMX CPUs keep transformers' bf16 layers (fused_layer.fuses_layers)")
@pytest.mark.parametrize("kernels", ["cpu", "torch", INDUCTOR])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_bf16_fused_layers_give_the_logits_of_transformers_layers(model_type, kernels, tmp_path):
    """The same engine, products and attention kernel, the layers fused or not: a prefill and a chain verify give
    the same bits with every device's operators (they round where transformers' bf16 operators do; inductor's
    where told to emulate those roundings)."""
    path = save_tiny(model_type, tmp_path)
    assert torch.equal(passes(path, torch.bfloat16, kernels), passes(path, torch.bfloat16, None))


@pytest.mark.parametrize("kernels", ["torch", INDUCTOR])
def test_fp32_fused_layers_over_torch_operators_give_transformers_logits(kernels, tmp_path):
    path = save_tiny("qwen3", tmp_path)  # the q and k norms too
    assert torch.allclose(passes(path, torch.float32, kernels), passes(path, torch.float32, None), atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_bf16_fused_layers_over_emulated_npu_operators_stay_within_the_start_up_bound(model_type, tmp_path):
    """EMULATION of torch_npu's operators, which round once where transformers' round after each operator: within
    the start-up check's bound."""
    path = save_tiny(model_type, tmp_path)
    ours, theirs = passes(path, torch.bfloat16, "npu-emulation").float(), passes(path, torch.bfloat16, None).float()
    assert not torch.equal(ours, theirs)
    assert (ours - theirs).abs().max() <= tolerance(torch.bfloat16, theirs.abs().max().item())


def test_each_device_gets_its_operators():
    cuda, cpu, npu = torch.device("cuda"), torch.device("cpu"), SimpleNamespace(type="npu")  # torch_npu's device
    compiled = device_kernels(cuda, torch.float16)
    assert isinstance(compiled, TorchKernels) and compiled.compiled
    assert isinstance(device_kernels(cpu, torch.bfloat16), CpuKernels)
    assert device_kernels(cpu, torch.float16) is None
    with mock.patch.dict("sys.modules", torch_npu=npu_emulation):
        assert isinstance(device_kernels(npu, torch.bfloat16), NpuKernels)
    assert fuses_layers(cuda, torch.float16) and fuses_layers(npu, torch.bfloat16)
    assert not fuses_layers(cpu, torch.float16)
