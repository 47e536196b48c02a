import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from verifier_service import cpu_linear
from verifier_service.cpu_linear import (
    MEASURED_ROWS,
    WAYS,
    MeasuredLinear,
    add_measured_linears,
    fastest_ways,
    measures_linear_ways,
    way_seconds,
)

CYCLING = tuple(i % len(WAYS) for i in range(len(MEASURED_ROWS)))  # F.linear at 1 row, W_t at 2, W first at 3, ...


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 13, 100])
def test_a_measured_linear_computes_what_the_linear_did_at_any_number_of_rows(rows):
    torch.manual_seed(0)
    linear = nn.Linear(8, 5)
    x = torch.randn(1, rows, 8)
    expected = linear(x)
    measured = MeasuredLinear(linear, CYCLING)
    assert measured.weight_t.is_contiguous() and measured.weight_t.shape == (8, 5)
    out = measured(x)
    assert out.is_contiguous()  # a strided output would slow attention down
    torch.testing.assert_close(out, expected)


def test_each_row_count_takes_the_way_measured_for_it_or_the_largest_count_below(monkeypatch):
    used = []

    def recorder(index):
        def way(x, weight, weight_t):
            used.append(index)
            return WAYS[index](x, weight, weight_t)
        return way

    linear = MeasuredLinear(nn.Linear(8, 5, bias=False), CYCLING)
    monkeypatch.setattr(cpu_linear, "WAYS", tuple(recorder(i) for i in range(len(WAYS))))

    def way_for(rows):
        used.clear()
        linear(torch.ones(1, rows, 8))
        return used[0]

    assert [way_for(rows) for rows in MEASURED_ROWS] == list(CYCLING)
    assert way_for(5) == way_for(4)  # between 4 and 6
    assert way_for(1000) == CYCLING[-1]


def test_the_transposed_copy_is_kept_only_where_a_row_count_uses_it():
    assert MeasuredLinear(nn.Linear(8, 5), (0, 2) * 6).weight_t is None
    assert MeasuredLinear(nn.Linear(8, 5), (0, 1) * 6).weight_t is not None


def test_every_way_is_timed_at_every_measured_row_count():
    weight = torch.randn(16, 8)
    seconds = way_seconds(weight, weight.t().contiguous(), torch.zeros(1024), repeats=1)
    assert len(seconds) == len(MEASURED_ROWS) and all(len(times) == len(WAYS) for times in seconds)
    assert all(t > 0 for times in seconds for t in times)


def test_another_way_replaces_f_linear_only_by_a_clear_margin_and_among_the_candidates():
    seconds = ((1.0, 0.5, 0.7), (1.0, 0.95, 0.99), (1.0, 0.8, 0.3))
    assert fastest_ways(seconds) == (1, 0, 2)  # the 5% win is a near tie
    assert fastest_ways(seconds, candidates=(0, 1)) == (1, 0, 1)


def test_the_weight_first_way_serves_only_passes_of_a_few_rows():
    weight_first_fastest = ((1.0, 0.8, 0.3),) * len(MEASURED_ROWS)
    chosen = dict(zip(MEASURED_ROWS, fastest_ways(weight_first_fastest)))
    assert chosen[2] == chosen[6] == WAYS.index(cpu_linear.by_weight_first)
    assert chosen[8] == chosen[64] == WAYS.index(cpu_linear.by_transposed)


def test_every_linear_of_a_tied_model_is_replaced_and_the_logits_stay():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 11]])
    with torch.inference_mode():
        expected = model(ids).logits
    added = add_measured_linears(model)
    assert not any(type(module) is nn.Linear for module in model.modules())
    kept = [module.weight_t for module in model.modules() if isinstance(module, MeasuredLinear)
            and module.weight_t is not None]
    assert added == sum(weight_t.nbytes for weight_t in kept)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # still tied
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected)


def test_only_fp32_on_an_mkl_cpu_without_tensor_parallelism_measures_them(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    assert measures_linear_ways(cpu, torch.float32, tensor_parallel=False)
    assert not measures_linear_ways(cpu, torch.bfloat16, tensor_parallel=False)
    assert not measures_linear_ways(cpu, torch.float32, tensor_parallel=True)
    assert not measures_linear_ways(torch.device("cuda"), torch.float32, tensor_parallel=False)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)  # e.g. an ARM build
    assert not measures_linear_ways(cpu, torch.float32, tensor_parallel=False)


def test_the_runner_serves_fp32_on_a_cpu_with_measured_linears(runner):
    assert not any(type(module) is nn.Linear for module in runner.model.modules())
    assert any(isinstance(module, MeasuredLinear) for module in runner.model.modules())
