import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from verifier_service import cpu_linear, tuning_cache
from verifier_service.cpu_linear import (
    MEASURED_ROWS,
    WAYS,
    MeasuredLinear,
    add_measured_linears,
    fastest_ways,
    layout_bytes,
    measures_linear_ways,
    reorders,
    sweep_seconds,
)

CYCLING = tuple(i % len(WAYS) for i in range(len(MEASURED_ROWS)))  # F.linear at 1 row, W_t at 2, W first at 3, ...
INF = float("inf")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 13, 100])
def test_a_measured_linear_computes_what_the_linear_did_at_any_number_of_rows(rows):
    torch.manual_seed(0)
    linear = nn.Linear(8, 5)
    x = torch.randn(1, rows, 8)
    expected = linear(x)
    measured = MeasuredLinear(linear, CYCLING)
    assert measured.weight_t.is_contiguous() and measured.weight_t.shape == (8, 5)
    assert measured.weight_reordered is not None
    out = measured(x)
    assert out.is_contiguous()  # a strided output would slow attention down
    torch.testing.assert_close(out, expected)


def test_each_row_count_takes_the_way_measured_for_it_or_the_largest_count_below(monkeypatch):
    used = []

    def recorder(index):
        def way(x, linear):
            used.append(index)
            return WAYS[index](x, linear)
        return way

    recorders = tuple(recorder(i) for i in range(len(WAYS)))
    monkeypatch.setattr(cpu_linear, "WAYS", recorders)
    for name, way in zip(("by_linear", "by_transposed", "by_weight_first", "by_reordered"), recorders):
        monkeypatch.setattr(cpu_linear, name, way)  # so the layouts each way reads are held
    linear = MeasuredLinear(nn.Linear(8, 5, bias=False), CYCLING)

    def way_for(rows):
        used.clear()
        linear(torch.ones(1, rows, 8))
        return used[0]

    assert [way_for(rows) for rows in MEASURED_ROWS] == list(CYCLING)
    assert way_for(5) == way_for(4)  # between 4 and 6
    assert way_for(1000) == CYCLING[-1]


def test_each_layout_is_held_only_while_a_row_count_uses_it():
    measured = MeasuredLinear(nn.Linear(8, 5))
    assert measured.weight_t is None and measured.weight_reordered is None and measured.layout_bytes() == 0
    measured.use((0, 1) * 6)
    assert measured.weight_t is not None and measured.weight_reordered is None
    assert measured.layout_bytes() == measured.weight.nbytes
    measured.use((3, 2) * 6)
    assert measured.weight_t is None and measured.weight_reordered is not None


def test_a_sweep_times_every_competing_way_at_every_row_count_summed_per_shape(monkeypatch):
    calls = []

    def recorder(index):
        def way(x, linear):
            calls.append((index, x.shape[0], tuple(linear.weight.shape)))
            return WAYS[0](x, linear)
        return way

    monkeypatch.setattr(cpu_linear, "WAYS", tuple(recorder(i) for i in range(len(WAYS))))
    monkeypatch.setattr(cpu_linear, "competes", lambda way, rows: way is not cpu_linear.WAYS[2] or rows <= 6)
    linears = [MeasuredLinear(nn.Linear(8, 5)), MeasuredLinear(nn.Linear(8, 5)), MeasuredLinear(nn.Linear(5, 8))]
    seconds = sweep_seconds(linears, repeats=2)
    assert set(seconds) == {(5, 8), (8, 5)}
    for shape, per_rows in seconds.items():
        for rows, times in zip(MEASURED_ROWS, per_rows):
            assert (times[2] == INF) == (rows > 6)
            assert all(0 < t < INF for i, t in enumerate(times) if i != 2)
            for way in range(len(WAYS)):  # one warm-up call per shape, then every layer of it in each of 2 sweeps
                expected = 0 if (way == 2 and rows > 6) else 1 + 2 * (2 if shape == (5, 8) else 1)
                assert calls.count((way, rows, shape)) == expected


def test_another_way_replaces_f_linear_only_by_a_clear_margin():
    seconds = [[1.0, 0.5, 0.7, INF, 0.6], [1.0, 0.95, 0.99, 0.97, 0.96], [1.0, 0.8, 0.3, 0.4, 0.5],
               [1.0, 0.8, INF, 0.6, 0.7], [1.0, 0.8, 0.9, 0.6, 0.4]]
    assert fastest_ways(seconds) == (1, 0, 2, 3, 4)  # the 5% win is a near tie


def test_the_weight_first_way_competes_only_for_passes_of_a_few_rows():
    assert cpu_linear.competes(cpu_linear.by_weight_first, 6)
    assert not cpu_linear.competes(cpu_linear.by_weight_first, 8)
    assert cpu_linear.competes(cpu_linear.by_transposed, 64)


def test_the_kernel_competes_only_for_passes_of_a_few_rows():
    assert cpu_linear.competes(cpu_linear.by_kernel, 8)
    assert not cpu_linear.competes(cpu_linear.by_kernel, 12)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 40), (37, 13), (576, 197)])
def test_the_kernel_computes_f_linear_at_every_row_count_it_takes(threads, in_features, out_features):
    """Odd sizes reach the kernel's tails: inputs past its 16-wide vectors, outputs past its tiles."""
    torch.manual_seed(0)
    linear = MeasuredLinear(nn.Linear(in_features, out_features, bias=False), (4,) * len(MEASURED_ROWS))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 10):
            x = torch.randn(1, rows, in_features)
            torch.testing.assert_close(linear(x), F.linear(x, linear.weight), rtol=1e-5, atol=1e-5)
            strided = torch.randn(1, in_features, rows).transpose(1, 2)  # as a transposed attention output
            torch.testing.assert_close(linear(strided), F.linear(strided, linear.weight), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_the_kernel_gives_a_row_the_same_bits_alone_and_in_any_batch():
    torch.manual_seed(0)
    linear = MeasuredLinear(nn.Linear(96, 50, bias=False), (4,) * len(MEASURED_ROWS))
    batch = torch.randn(7, 96)
    together = linear(batch)
    for rows in range(1, 8):  # the last row's product in batches of every size: other tiles, other remainders
        assert torch.equal(linear(batch[rows - 1:rows]), together[rows - 1:rows])
        assert torch.equal(linear(batch[:rows]), together[:rows])


def test_the_reordered_way_competes_only_where_onednn_reorders(monkeypatch):
    assert reorders()  # the x86 CPU build CI runs
    monkeypatch.setattr(cpu_linear, "reorders", lambda: False)
    assert not cpu_linear.competes(cpu_linear.by_reordered, 4)


def _tiny_tied_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).eval()


def test_every_linear_of_a_tied_model_is_replaced_and_the_logits_stay():
    model = _tiny_tied_model()
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 11]])
    with torch.inference_mode():
        expected = model(ids).logits
    add_measured_linears(model)
    assert not any(type(module) is nn.Linear for module in model.modules())
    measured = [module for module in model.modules() if isinstance(module, MeasuredLinear)]
    assert layout_bytes(model) == sum(module.layout_bytes() for module in measured)
    for module in measured:  # each holds just the layouts its ways read
        ways = {WAYS[way] for way in module.ways}
        assert (module.weight_t is not None) == (cpu_linear.by_transposed in ways)
        assert (module.weight_reordered is not None) == (cpu_linear.by_reordered in ways)
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



def test_ways_measured_beside_another_process_serve_that_start_but_are_not_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning_cache, "QUIET_SHARE", -1.0)  # any use of the cores counts as disturbed
    monkeypatch.setattr(tuning_cache, "QUIET_SLACK_S", 0.0)
    sweep = cpu_linear.sweep_seconds
    monkeypatch.setattr(cpu_linear, "sweep_seconds", lambda linears: time.sleep(0.05) or sweep(linears))  # a tick
    model = _tiny_tied_model()
    choices = add_measured_linears(model, tmp_path)
    assert not list(tmp_path.iterdir())
    assert {tuple(shape) for shape, _ in choices} == {tuple(module.weight.shape) for module in model.modules()
                                                    if isinstance(module, MeasuredLinear)}


def test_the_ways_measured_at_one_start_are_read_at_the_next_and_measured_again_when_the_key_changes(
        tmp_path, monkeypatch):
    measured_ways = {}
    first = _tiny_tied_model()
    add_measured_linears(first, tmp_path)
    for module in first.modules():
        if isinstance(module, MeasuredLinear):
            measured_ways[tuple(module.weight.shape)] = module.ways
    assert len(list(tmp_path.glob("linear-ways-*.json"))) == 1

    def no_sweeps(linears, repeats=2):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_linear, "sweep_seconds", no_sweeps)
    second = _tiny_tied_model()
    add_measured_linears(second, tmp_path)
    for module in second.modules():
        if isinstance(module, MeasuredLinear):
            assert module.ways == measured_ways[tuple(module.weight.shape)]
            # Only the layouts the stored ways read, as after a measurement.
            assert (module.weight_t is not None) == (cpu_linear.by_transposed in {WAYS[w] for w in module.ways})

    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    with pytest.raises(AssertionError, match="measured again"):
        add_measured_linears(_tiny_tied_model(), tmp_path)
