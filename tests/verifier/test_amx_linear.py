"""bf16 linear layers through our AMX kernel: a row's bits do not depend on the
other rows or the threads, the products are the model's, and the batch-invariant
mode takes them on CPUs with AMX. The kernel's tests skip on other CPUs; the
packing's run everywhere."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from verifier_service.amx_linear import AmxLinear, amx_ready, pack
from verifier_service.batch_invariant import PaddedLinear, make_linears_invariant, spread_values

CPU = torch.device("cpu")
needs_amx = pytest.mark.skipif(not amx_ready(), reason="this CPU has no AMX-BF16 (or the OS does not grant it)")


def layer(out: int, inputs: int, seed: int, bias: bool = False) -> nn.Linear:
    linear = nn.Linear(inputs, out, bias=bias).bfloat16()
    generator = torch.Generator().manual_seed(seed)
    linear.weight.data = spread_values(generator, CPU, torch.bfloat16, out, inputs)
    return linear


def test_the_weight_is_packed_in_tiles_of_16_outputs_by_16_input_pairs():
    weight = torch.arange(40 * 70, dtype=torch.float32).view(40, 70).bfloat16()  # 3 x 3 tiles, both padded
    packed = pack(weight)
    assert packed.shape == (3, 3, 16, 16, 2)
    for output, inputs in ((0, 0), (17, 33), (39, 69), (5, 64)):
        assert packed[output // 16, inputs // 32, inputs % 32 // 2, output % 16, inputs % 2] == weight[output, inputs]
    assert not packed[2, :, :, 8:].any() and not packed[:, 2, 3:].any()  # outputs 40-47, inputs 70-95: zeros


@needs_amx
@pytest.mark.parametrize("out,inputs", [(1536, 576), (576, 1536), (40, 70)], ids=["mlp-up", "mlp-down", "ragged"])
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(out, inputs):
    linear = AmxLinear(layer(out, inputs, seed=0))
    x = spread_values(torch.Generator().manual_seed(1), CPU, torch.bfloat16, 70, inputs)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i:i + 1]) for i in range(70)])
        for rows in (2, 3, 15, 16, 17, 33, 64, 70):
            assert torch.equal(linear(x[:rows]), alone[:rows]), rows
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(linear(x), alone)  # the split across threads does not change a sum
        finally:
            torch.set_num_threads(threads)
        # The model's product, as oneDNN rounds it (its own order): within bf16's rounding of the output.
        expected = F.linear(x.float(), linear.weight.float())
        assert torch.allclose(alone.float(), expected, rtol=2 ** -7, atol=1e-3 * expected.abs().max().item())


@needs_amx
def test_a_bias_and_leading_dimensions_are_kept():
    linear = layer(48, 64, seed=2, bias=True)
    linear.bias.data = torch.randn(48).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.inference_mode():
        out = AmxLinear(linear)(x)
        assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
        assert torch.allclose(out.float(), linear(x).float(), rtol=2 ** -6, atol=0.05)


@needs_amx
def test_the_invariant_mode_takes_the_kernel_for_bf16_layers_on_amx():
    model = nn.Sequential(layer(1536, 576, seed=3), layer(576, 1536, seed=4), nn.Linear(16, 16))
    assert make_linears_invariant(model)
    assert [type(module) for module in model] == [AmxLinear, AmxLinear, PaddedLinear]  # fp32: padded as before
    x = spread_values(torch.Generator().manual_seed(5), CPU, torch.bfloat16, 9, 576)
    with torch.inference_mode():
        assert torch.equal(model[1](model[0](x))[4], model[1](model[0](x[4:5]))[0])
