"""The bf16 kernel for passes of a few rows on CPUs with AVX512-BF16 (bf16_linear.py): it must give every row
oneDNN's bits, at any row count and across the switch to oneDNN, or not be used."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.verifier.conftest import spread_bf16_layer
from verifier_service import bf16_linear
from verifier_service.batch_invariant import PaddedLinear, make_linears_invariant, spread_values
from verifier_service.bf16_linear import AHEAD_ROWS, MAX_ROWS, StreamedLinear, bf16_linear_ready, pack

CPU = torch.device("cpu")
needs_bf16_kernel = pytest.mark.skipif(not bf16_linear_ready(), reason="this CPU has no AVX512-BF16")


def test_the_packed_weight_holds_each_16_outputs_input_pairs_side_by_side():
    weight = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).bfloat16()
    packed = pack(weight)
    assert packed.shape == (2, 3, 16, 2)
    for group, pair, output, half in ((0, 0, 0, 0), (1, 2, 15, 1), (0, 1, 7, 1), (1, 0, 3, 0)):
        assert packed[group, pair, output, half] == weight[16 * group + output, 2 * pair + half]


@needs_bf16_kernel
@pytest.mark.parametrize("shape, bias", [((4864, 896), False), ((896, 4864), False), ((896, 896), True),
                                         ((128, 896), True), ((1536, 576), False), ((80, 96), True)])
def test_a_streamed_layer_gives_each_row_onednns_bits_alone_and_in_any_pass(shape, bias):
    model = nn.Sequential(spread_bf16_layer(*shape, seed=1, bias=bias))
    assert make_linears_invariant(model)
    streamed = model[0]
    assert isinstance(streamed, StreamedLinear) and streamed.block in (*bf16_linear.BLOCKS, shape[1])
    x = spread_values(torch.Generator().manual_seed(2), CPU, torch.bfloat16, MAX_ROWS + 8, shape[1])
    with torch.inference_mode():
        alone = torch.cat([streamed(x[i:i + 1]) for i in range(len(x))])
        # Up to MAX_ROWS rows the kernel computes (from AHEAD_ROWS fetching ahead); beyond, oneDNN: a row's bits
        # are the same either way.
        for rows in (2, 5, AHEAD_ROWS, MAX_ROWS, MAX_ROWS + 1, MAX_ROWS + 8):
            assert torch.equal(streamed(x[:rows]), alone[:rows]), rows
        padded = streamed.padded(x)
        assert torch.equal(padded, alone)
        # And they are a product's: near fp32's.
        exact = F.linear(x.float(), streamed.weight.float(), None if streamed.bias is None else streamed.bias.float())
        assert torch.allclose(alone.float(), exact, rtol=2 ** -7, atol=exact.abs().max().item() * 2 ** -7)


@needs_bf16_kernel
def test_a_layer_whose_bits_no_block_gives_stays_with_onednn(monkeypatch):
    linear = spread_bf16_layer(256, 512, seed=3)
    monkeypatch.setattr(bf16_linear, "product", lambda rows, packed, bias, out_features, block:
                        torch.zeros(rows.shape[0], out_features, dtype=torch.bfloat16))
    model = nn.Sequential(linear)
    assert make_linears_invariant(model)
    assert type(model[0]) is PaddedLinear


def test_only_bf16_cpu_layers_of_whole_vectors_are_streamed():
    assert bf16_linear.fits(spread_bf16_layer(32, 64, seed=4))
    assert not bf16_linear.fits(nn.Linear(64, 32))  # fp32
    assert not bf16_linear.fits(spread_bf16_layer(24, 64, seed=5))  # outputs not a multiple of 16
    assert not bf16_linear.fits(spread_bf16_layer(32, 63, seed=6))  # an odd number of inputs
