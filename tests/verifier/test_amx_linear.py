"""bf16 linear layers through our AMX kernel: a row's bits do not depend on the
other rows or the threads, the products are the model's (a SwiGLU MLP's too), and
the batch-invariant mode takes them on CPUs with AMX. The kernel's tests skip on
other CPUs; the packing's run everywhere."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from tests.verifier.conftest import spread_bf16_layer
from verifier_service.amx_linear import AmxGatedMlp, AmxLinear, amx_ready, interleave, pack
from verifier_service.batch_invariant import PaddedLinear, make_linears_invariant, spread_values

CPU = torch.device("cpu")
needs_amx = pytest.mark.skipif(not amx_ready(), reason="this CPU has no AMX-BF16 (or the OS does not grant it)")


def test_the_weight_is_packed_in_tiles_of_16_outputs_by_16_input_pairs():
    weight = torch.arange(40 * 70, dtype=torch.float32).view(40, 70).bfloat16()  # 3 x 3 tiles, both padded
    packed = pack(weight)
    assert packed.shape == (3, 3, 16, 16, 2)
    for output, inputs in ((0, 0), (17, 33), (39, 69), (5, 64)):
        assert packed[output // 16, inputs // 32, inputs % 32 // 2, output % 16, inputs % 2] == weight[output, inputs]
    assert not packed[2, :, :, 8:].any() and not packed[:, 2, 3:].any()  # outputs 40-47, inputs 70-95: zeros


def swiglu(hidden: int, intermediate: int, seed: int) -> Qwen2MLP:
    mlp = Qwen2MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu")).bfloat16()
    for index, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        linear = getattr(mlp, name)
        generator = torch.Generator().manual_seed(seed + index)
        linear.weight.data = spread_values(generator, CPU, torch.bfloat16, *linear.weight.shape) * 0.05
    return mlp


def fp32_swiglu(mlp: Qwen2MLP, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = (getattr(mlp, name).weight.float() for name in ("gate_proj", "up_proj", "down_proj"))
    return F.linear(F.silu(F.linear(x.float(), gate)) * F.linear(x.float(), up), down)


def test_a_gated_mlp_packs_its_gate_and_up_blocks_alternately():
    gate, up = pack(torch.zeros(40, 64).bfloat16()), pack(torch.ones(40, 64).bfloat16())
    packed = interleave(gate, up)
    assert packed.shape == (6, 2, 16, 16, 2)
    assert not packed[0::2].any() and packed[1::2, :, :, :8].all()  # blocks 0, 2, 4 the gate's; 1, 3, 5 up's


def amx_layer(kind: str, out: int, inputs: int) -> tuple[nn.Module, int]:
    if kind == "linear":
        return AmxLinear(spread_bf16_layer(out, inputs, seed=0)), inputs
    return AmxGatedMlp(swiglu(out, inputs, seed=0)), out  # out: the hidden size, inputs: the intermediate


@needs_amx
@pytest.mark.parametrize("kind", ["linear", "gated-mlp"])
@pytest.mark.parametrize("out,inputs", [(1536, 576), (576, 1536), (40, 70)], ids=["wide", "narrow", "ragged"])
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(kind, out, inputs):
    module, width = amx_layer(kind, out, inputs)
    x = spread_values(torch.Generator().manual_seed(1), CPU, torch.bfloat16, 70, width)
    with torch.inference_mode():
        alone = torch.cat([module(x[i:i + 1]) for i in range(70)])
        for rows in (2, 3, 15, 16, 17, 33, 64, 70):
            assert torch.equal(module(x[:rows]), alone[:rows]), rows
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(module(x), alone)  # the split across threads does not change a sum
        finally:
            torch.set_num_threads(threads)
    if kind == "linear":  # the model's product, as oneDNN rounds it (its own order): within bf16's rounding
        expected = F.linear(x.float(), module.weight.float())
        assert torch.allclose(alone.float(), expected, rtol=2 ** -7, atol=1e-3 * expected.abs().max().item())


@needs_amx
def test_the_gated_mlp_is_nearer_fp32_than_the_model_in_bf16():
    """One rounding of silu(gate) * up rather than four: no farther from the fp32 computation than transformers'
    bf16 forward, and finite where the gate saturates the sigmoid either way."""
    mlp = swiglu(96, 200, seed=7)
    fused = AmxGatedMlp(mlp)
    x = spread_values(torch.Generator().manual_seed(8), CPU, torch.bfloat16, 64, 96)
    with torch.inference_mode():
        for scale in (1.0, 300.0):  # 300: gates far past where e^-|gate| underflows
            inputs = x * scale
            expected = fp32_swiglu(mlp, inputs)
            ours, theirs = (fused(inputs).float() - expected).abs().max(), (mlp(inputs).float() - expected).abs().max()
            assert ours <= theirs and ours <= 2 ** -7 * expected.abs().max(), (scale, ours, theirs)


@needs_amx
def test_the_invariant_mode_fuses_swiglu_mlps_only():
    model = nn.ModuleDict({"swiglu": swiglu(64, 128, seed=9),
                           "gelu": GemmaMLP(SimpleNamespace(hidden_size=64, intermediate_size=128,
                                                            hidden_act="gelu_pytorch_tanh")).bfloat16()})
    assert make_linears_invariant(model)
    assert type(model["swiglu"]) is AmxGatedMlp and type(model["swiglu"].down_proj) is AmxLinear
    assert type(model["gelu"]) is GemmaMLP and type(model["gelu"].gate_proj) is AmxLinear


@needs_amx
def test_a_bias_and_leading_dimensions_are_kept():
    linear = spread_bf16_layer(48, 64, seed=2, bias=True)
    linear.bias.data = torch.randn(48).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.inference_mode():
        out = AmxLinear(linear)(x)
        assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
        assert torch.allclose(out.float(), linear(x).float(), rtol=2 ** -6, atol=0.05)


@needs_amx
def test_the_invariant_mode_takes_the_kernel_for_bf16_layers_on_amx():
    model = nn.Sequential(spread_bf16_layer(1536, 576, seed=3), spread_bf16_layer(576, 1536, seed=4), nn.Linear(16, 16))
    assert make_linears_invariant(model)
    assert [type(module) for module in model] == [AmxLinear, AmxLinear, PaddedLinear]  # fp32: padded as before
    x = spread_values(torch.Generator().manual_seed(5), CPU, torch.bfloat16, 9, 576)
    with torch.inference_mode():
        assert torch.equal(model[1](model[0](x))[4], model[1](model[0](x[4:5]))[0])
