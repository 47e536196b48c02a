"""--dtype auto on a CPU that multiplies bf16 natively: the verifier serves bf16 where its passes are batch-invariant
and pass the start-up check, and fp32 where they do not (rather than refusing what fp32 serves), through the same
load as `speclane serve` (workers.Rank0). The CPU's flag is forced, so these run on any x86 host."""

import pytest
import structlog
import torch

from tests.verifier.architectures import save_tiny
from verifier_service import workers
from verifier_service.config import VerifierConfig


def load(model_dir: str, **fields):
    config = VerifierConfig(model=model_dir, threads=1, tuning_cache=False, **fields)
    with structlog.testing.capture_logs() as logs:
        engine = workers.Rank0(config).load()
    return engine.runner, [entry for entry in logs if entry["event"] == "dtype_fallback"]


@pytest.fixture
def native_bf16(monkeypatch):
    monkeypatch.setattr(workers, "cpu_has_native_bf16", lambda: True)


def test_auto_serves_a_llama_in_bf16_with_invariant_passes(native_bf16, tmp_path):
    runner, fallbacks = load(save_tiny("llama", tmp_path))
    assert (runner.dtype, runner.batch_invariant, fallbacks) == (torch.bfloat16, True, [])


def test_auto_serves_fp32_where_the_cpu_has_no_native_bf16(monkeypatch, tmp_path):
    monkeypatch.setattr(workers, "cpu_has_native_bf16", lambda: False)
    runner, fallbacks = load(save_tiny("llama", tmp_path))
    assert (runner.dtype, fallbacks) == (torch.float32, [])


def test_auto_falls_back_to_fp32_for_attention_the_invariant_mode_does_not_compute(native_bf16, tmp_path):
    # Gemma 2 softcaps its scores and windows every other layer: bf16 would be refused, fp32 serves it.
    model_dir = save_tiny("gemma2", tmp_path)
    runner, fallbacks = load(model_dir)
    assert runner.dtype == torch.float32
    assert len(fallbacks) == 1 and "sliding window, softcapping or sinks" in fallbacks[0]["reason"]
    with pytest.raises(ValueError, match="sliding window, softcapping or sinks"):  # named bf16: refused, as before
        load(model_dir, dtype="bfloat16")


def test_auto_serves_an_moe_in_bf16_with_invariant_passes(native_bf16, tmp_path):
    # Its experts' and router's rows padded (invariant_moe.py): the half of the memory an MoE most needs.
    runner, fallbacks = load(save_tiny("qwen3_moe", tmp_path))
    assert (runner.dtype, runner.batch_invariant, fallbacks) == (torch.bfloat16, True, [])


def test_auto_falls_back_to_fp32_for_products_the_invariant_mode_does_not_cover(native_bf16, tmp_path):
    # Qwen3-Next's gated DeltaNet convolves its inputs with weights of its own.
    runner, fallbacks = load(save_tiny("qwen3_next", tmp_path))
    assert runner.dtype == torch.float32
    assert len(fallbacks) == 1 and "Conv1d" in fallbacks[0]["reason"]


def test_auto_serves_fp32_where_invariant_passes_are_switched_off(native_bf16, tmp_path):
    runner, fallbacks = load(save_tiny("llama", tmp_path), batch_invariant="off")
    assert (runner.dtype, fallbacks) == (torch.float32, [])
