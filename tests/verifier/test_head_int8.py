"""Weight-only int8 for a head's linear layers (heads/int8.py)."""

import torch
from torch import nn

from verifier_service.heads.int8 import Int8Linear, quantize_linears


def test_an_int8_linear_matches_the_float_one_within_its_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    quantized = Int8Linear(linear)
    x = torch.randn(2, 3, 64)
    expected = linear(x)
    got = quantized(x).float()
    assert quantized.weight.dtype is torch.int8 and got.shape == expected.shape
    # One scale per output row: the error is at most about 1/127 of each row's largest weight, plus bf16's rounding.
    assert torch.allclose(got, expected, rtol=0.03, atol=0.03)
    assert not torch.allclose(got, (linear(x) - linear.bias).float(), atol=0.03)  # the bias is applied


def test_only_linears_whose_input_width_the_kernel_takes_are_quantized():
    inner = nn.Sequential(nn.Linear(16, 40), nn.Linear(40, 8))
    model = nn.Sequential(nn.Linear(32, 16), inner, nn.LayerNorm(8)).bfloat16()
    assert quantize_linears(model) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][0], Int8Linear)
    assert isinstance(model[1][1], nn.Linear)  # 40 inputs: not a multiple of the kernel's block of 16
    x = torch.randn(5, 32)
    assert model(x.bfloat16()).shape == (5, 8)
