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


def test_a_packaged_model_name_is_a_model():
    config = VerifierConfig(model="smollm2-135m-instruct")
    assert config.model_name == "smollm2-135m-instruct"


@pytest.mark.parametrize("overrides, message", [
    ({"model": ""}, "model is required"),
    ({"model": "/nonexistent"}, "neither a packaged model"),
    ({"device": "gpu"}, "device"),
    ({"dtype": "fp8"}, "dtype"),
    ({"threads": -1}, "threads"),
    ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"max_kv_tokens": -1}, "max_kv_tokens"),
    ({"max_kv_tokens": 8, "kv_block_size": 16}, "at least one block"),
    ({"kv_memory_fraction": 0}, "kv_memory_fraction"),
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
