"""VerifierConfig: defaults, validation, and flags/env through speclane.config."""

import argparse
import os

import pytest

from speclane.config import add_arguments, from_namespace
from verifier_service.config import ENV_PREFIX, VerifierConfig


def test_defaults(tiny_model_dir):
    config = VerifierConfig(model=tiny_model_dir)
    assert config.model_name == os.path.basename(tiny_model_dir)
    assert (config.address, config.device, config.dtype, config.threads) == ("127.0.0.1:50062", "auto", "auto", 0)
    assert config.max_concurrent_rpcs == 256


def test_a_head_may_have_int8_weights(tiny_model_dir):
    assert VerifierConfig(model=tiny_model_dir, head_dtype="int8").head_dtype == "int8"


def test_a_packaged_model_name_is_a_model():
    config = VerifierConfig(model="smollm2-135m-instruct")
    assert config.model_name == "smollm2-135m-instruct"


@pytest.mark.parametrize("overrides, message", [
    ({"model": ""}, "model is required"),
    ({"model": "/nonexistent"}, "neither a packaged model"),
    ({"device": "gpu"}, "device"),
    ({"dtype": "fp8"}, "dtype"),
    ({"dtype": "int8"}, "dtype must be one of"),  # int8 is for the head's weights only
    ({"head_dtype": "int4"}, "head_dtype"),
    ({"threads": -1}, "threads"),
    ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"num_gpu_blocks_override": -1}, "num_gpu_blocks_override"),
    ({"kv_cache_space": -1}, "kv_cache_space"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"reference_check": "maybe"}, "reference_check"),
    ({"attention_backend": "FLASH_ATTN"}, "attention_backend must be one of"),
    ({"attention_backend": "FLEX_ATTENTION", "batch_invariant": "on"}, "leave --attention-backend auto"),
    ({"max_batch_tokens": 0}, "max_batch_tokens"),
    ({"max_queue_wait": -1}, "max_queue_wait"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"log_level": "loud"}, "log_level"),
])
def test_invalid_values_are_refused(tiny_model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        VerifierConfig(**{"model": tiny_model_dir, **overrides})


def test_flags_and_environment(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "MODEL", tiny_model_dir)
    monkeypatch.setenv(ENV_PREFIX + "THREADS", "2")
    parser = argparse.ArgumentParser()
    add_arguments(parser, VerifierConfig, ENV_PREFIX)
    config = from_namespace(VerifierConfig, parser.parse_args(["--model-name", "tiny", "--device", "cpu"]))
    assert (config.model, config.model_name, config.device, config.threads) == (tiny_model_dir, "tiny", "cpu", 2)


@pytest.mark.parametrize("overrides, message", [
    ({"gpu_memory_utilization": -0.1}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
])
def test_vllm_memory_and_seed_flags_are_checked(tiny_model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        VerifierConfig(**{"model": tiny_model_dir, **overrides})


def test_vllm_memory_and_seed_flags(tiny_model_dir):
    default = VerifierConfig(model=tiny_model_dir)
    assert (default.gpu_memory_utilization, default.kv_cache_space, default.seed) == (0.9, 4.0, 0)  # vLLM's
    parser = argparse.ArgumentParser()
    add_arguments(parser, VerifierConfig, ENV_PREFIX)
    config = from_namespace(VerifierConfig, parser.parse_args(
        ["--model", tiny_model_dir, "--gpu-memory-utilization", "0.9", "--seed", "1234",
         "--attention-backend", "FLEX_ATTENTION"]))
    assert (config.gpu_memory_utilization, config.seed, config.attention_backend) == (0.9, 1234, "FLEX_ATTENTION")


@pytest.mark.parametrize("model, name", [
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("modelscope:Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
])
def test_a_hub_model_id_is_a_model_named_by_its_id(model, name):
    """As `vllm serve Qwen/...`: fetched at start, and served under its id."""
    config = VerifierConfig(model=model)
    assert (config.model, config.model_name) == (model, name)


def test_a_path_that_is_no_model_is_still_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a packaged model"):
        VerifierConfig(model=str(tmp_path / "missing" / "model"))
