import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from verifier_service.cpu_linear import (
    MEASURED_ROWS,
    TwoLayoutLinear,
    add_transposed_weights,
    gains_from_transposed_weights,
    transposed_wins,
)

ALTERNATING = tuple(i % 2 == 1 for i in range(len(MEASURED_ROWS)))  # F.linear at 1 row, W_t at 2, ...


@pytest.mark.parametrize("rows", [1, 3, 4, 13, 100])
def test_a_two_layout_linear_computes_what_the_linear_did_at_any_number_of_rows(rows):
    torch.manual_seed(0)
    linear = nn.Linear(8, 5)
    x = torch.randn(1, rows, 8)
    expected = linear(x)
    two_layouts = TwoLayoutLinear(linear, ALTERNATING)
    assert two_layouts.weight_t.is_contiguous() and two_layouts.weight_t.shape == (8, 5)
    torch.testing.assert_close(two_layouts(x), expected)


def test_each_row_count_takes_the_layout_measured_for_it_or_the_largest_count_below():
    linear = TwoLayoutLinear(nn.Linear(8, 5, bias=False), ALTERNATING)
    with torch.no_grad():
        linear.weight_t.zero_()  # now only the original layout gives a non-zero output

    def used_transposed(rows):
        return linear(torch.ones(1, rows, 8)).abs().sum() == 0

    assert [used_transposed(rows) for rows in MEASURED_ROWS] == list(ALTERNATING)
    assert used_transposed(5) == used_transposed(4)  # between 4 and 6
    assert used_transposed(1000) == ALTERNATING[-1]


def test_the_layouts_are_timed_at_every_measured_row_count():
    weight = torch.randn(16, 8)
    wins = transposed_wins(weight, weight.t().contiguous(), torch.zeros(1024), repeats=1)
    assert len(wins) == len(MEASURED_ROWS)


def test_every_linear_of_a_tied_model_is_replaced_and_the_logits_stay():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 11]])
    with torch.inference_mode():
        expected = model(ids).logits
    linear_bytes = sum(module.weight.nbytes for module in model.modules() if type(module) is nn.Linear)
    assert add_transposed_weights(model) == linear_bytes
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # still tied
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected)


def test_only_fp32_on_an_mkl_cpu_without_tensor_parallelism_uses_them(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    assert gains_from_transposed_weights(cpu, torch.float32, tensor_parallel=False)
    assert not gains_from_transposed_weights(cpu, torch.bfloat16, tensor_parallel=False)
    assert not gains_from_transposed_weights(cpu, torch.float32, tensor_parallel=True)
    assert not gains_from_transposed_weights(torch.device("cuda"), torch.float32, tensor_parallel=False)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)  # e.g. an ARM build
    assert not gains_from_transposed_weights(cpu, torch.float32, tensor_parallel=False)


def test_the_runner_serves_fp32_on_a_cpu_with_both_layouts(runner):
    assert not any(type(module) is nn.Linear for module in runner.model.modules())
    assert any(isinstance(module, TwoLayoutLinear) for module in runner.model.modules())
