"""`speclane bench device` on the CPU with a tiny shape: every section runs and its numbers hold together."""

import json

import pytest

from speclane_cli.bench import device
from speclane_cli.main import main

TINY = dict(model_type="qwen3", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=128, tie_word_embeddings=False,
            max_position_embeddings=1024)


@pytest.mark.parametrize("invariant", ["off", "on"])
def test_the_device_bench_reports_rates_limits_and_draft_costs(invariant, tmp_path, monkeypatch):
    monkeypatch.setitem(device.SHAPES, "tiny", TINY)
    out = tmp_path / "device.json"
    assert main(["bench", "device", "--models", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--batches", "1,3",
                 "--steps", "2", "--drafts", "2", "--batch-invariant", invariant, "--json", str(out),
                 "--profile", str(tmp_path / "profile-"), "--layers", "fused,transformers"]) == 0
    result = json.loads(out.read_text())
    model = result["models"][0]
    assert model["attention_backend"] == ("batch-invariant" if invariant == "on" else "torch-sdpa")
    check = model["reference_check"]
    assert check["max_logit_difference"] <= check["allowed"]
    one, three = model["batches"]
    assert [one["sequences"], three["sequences"]] == [1, 3]
    for row in (one, three):
        assert row["decode_tokens_per_s"] > 0 and row["transformers_static_tokens_per_s"] > 0
        assert 0 < row["pass_host_ms"] <= row["pass_ms"] and row["verify_k2_vs_decode"] > 0
        assert row["sampled_vs_greedy"] == pytest.approx(
            row["sampled_decode_tokens_per_s"] / row["decode_tokens_per_s"], rel=0.01)
    assert one["share_of_weight_read_limit"] == pytest.approx(
        one["decode_tokens_per_s"] / model["weight_read_limit_tokens_per_s"], abs=1e-3)
    assert "aten::" in (tmp_path / "profile-tiny.txt").read_text()
    # The same weights again with transformers' own layers: a row per batch, each fused row's ratio to it.
    assert model["fused_layers"] == TINY["num_hidden_layers"]
    unfused = model["transformers_layers"]
    assert unfused["reference_check"]["max_logit_difference"] <= unfused["reference_check"]["allowed"]
    assert [row["sequences"] for row in unfused["batches"]] == [1, 3]
    for ours, theirs in zip(model["batches"], unfused["batches"]):
        assert ours["vs_transformers_layers"] == pytest.approx(
            ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], abs=1e-3)


@pytest.mark.e2e
def test_the_device_bench_serves_each_model_through_the_stack_with_each_method(tmp_path, monkeypatch):
    """--stack: the random model, given SmolLM2's tokenizer and vocabulary, served by `speclane serve` and
    measured over the HTTP API at each concurrency with each method."""
    monkeypatch.setitem(device.SHAPES, "tiny", TINY)
    out = tmp_path / "device.json"
    assert main(["bench", "device", "--models", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1",
                 "--steps", "2", "--drafts", "2", "--stack", "--stack-concurrency", "1,2", "--stack-max-tokens", "12",
                 "--json", str(out)]) == 0
    model = json.loads(out.read_text())["models"][0]
    assert model["vocab_size"] == 49152  # the tokenizer's
    rows = {(row["concurrency"], row["method"]): row for row in model["stack"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("none", "ngram", "suffix")}
    for (concurrency, method), row in rows.items():
        assert row["tokens_per_s"] > 0
        if method == "none":
            assert row["tokens_per_step"] < 1.2  # one token a step (and the prefill's)
        else:
            assert row["vs_none"] == pytest.approx(row["tokens_per_s"] / rows[concurrency, "none"]["tokens_per_s"],
                                                   abs=1e-3)
    assert (tmp_path / "serve-tiny.log").is_file()
