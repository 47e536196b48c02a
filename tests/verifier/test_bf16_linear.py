"""The bf16 kernel of CPUs with AVX512-BF16 (bf16_linear.py): it gives every row the same bits alone and in a
pass of any length, near fp32's product, and a model keeps only its packed weights but the output layer's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from tests.verifier.architectures import save_tiny
from tests.verifier.conftest import spread_bf16_layer
from verifier_service import bf16_linear
from verifier_service.batch_invariant import make_linears_invariant, spread_values
from verifier_service.bf16_linear import WIDE_ROWS, StreamedLinear, bf16_linear_ready, pack

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
def test_a_streamed_layer_gives_each_row_the_same_bits_alone_and_in_any_pass(shape, bias):
    linear = spread_bf16_layer(*shape, seed=1, bias=bias)
    streamed = StreamedLinear(linear, keep_weight=False)
    assert streamed.weight is None  # only the packed copy
    x = spread_values(torch.Generator().manual_seed(2), CPU, torch.bfloat16, 600, shape[1])
    with torch.inference_mode():
        alone = torch.cat([streamed(x[i:i + 1]) for i in range(len(x))])
        # Every one-tile pass (up to WIDE_ROWS rows), tiles of 4 x 4 rows fetching ahead, prompt chunks.
        for rows in (0, *range(2, WIDE_ROWS + 4), 64, 257, 600):
            assert torch.equal(streamed(x[:rows]), alone[:rows]), rows
        # And they are a product's: near fp32's.
        exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
        assert torch.allclose(alone.float(), exact, rtol=2 ** -7, atol=exact.abs().max().item() * 2 ** -7)


@needs_bf16_kernel
def test_a_model_keeps_only_the_packed_weights_but_its_output_layer_s(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(save_tiny("llama", tmp_path, {"hidden_size": 64}),
                                                 dtype=torch.bfloat16)
    ids = torch.tensor([[5, 9, 14, 3, 22]])
    with torch.inference_mode():
        before = model(ids).logits.float()
    assert make_linears_invariant(model)
    layers = [m for m in model.model.modules() if isinstance(m, StreamedLinear)]
    assert len(layers) == 2 * 7 and all(layer.weight is None for layer in layers)  # q, k, v, o, gate, up, down
    assert isinstance(model.lm_head, StreamedLinear) and model.lm_head.weight is not None
    with torch.inference_mode():
        after = model(ids).logits.float()
    assert torch.allclose(after, before, rtol=2 ** -5, atol=before.abs().max().item() * 2 ** -5)


def test_only_bf16_cpu_layers_of_whole_vectors_are_streamed():
    assert bf16_linear.fits(spread_bf16_layer(32, 64, seed=4))
    assert not bf16_linear.fits(nn.Linear(64, 32))  # fp32
    assert not bf16_linear.fits(spread_bf16_layer(24, 64, seed=5))  # outputs not a multiple of 16
    assert not bf16_linear.fits(spread_bf16_layer(32, 63, seed=6))  # an odd number of inputs
