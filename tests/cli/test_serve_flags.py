"""`speclane serve` takes vLLM's --gpu-memory-utilization and --seed and hands
them to the verifier process; a hub model id is fetched once and served under
its id, as `vllm serve org/name` does."""

import argparse
import json

import pytest
from huggingface_hub import constants as hf_constants

from speclane.config import to_argv
from speclane_cli import serve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(tmp_path)


def test_vllm_memory_and_seed_flags_reach_the_verifier(model_dir):
    _, verifier, _ = serve.configs_from_args(parse([model_dir, "--gpu-memory-utilization", "0.85", "--seed", "42"]))
    assert (verifier.gpu_memory_utilization, verifier.seed) == (0.85, 42)
    argv = to_argv(verifier)  # the verifier process's command line
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.85"
    assert argv[argv.index("--seed") + 1] == "42"


def test_a_hub_model_id_is_served_under_its_id(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    _, verifier, gateway = serve.configs_from_args(parse(["tiny-org/tiny-llama"]))
    assert verifier.model == gateway.model == str(snapshot)
    assert verifier.model_name == gateway.served_model_name == "tiny-org/tiny-llama"


def test_the_drafter_keeps_its_trees_under_speclane_home_per_model(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLANE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECLANE_DRAFTER_SNAPSHOT_PATH", raising=False)
    drafter, _, _ = serve.configs_from_args(parse([model_dir, "--served-model-name", "org/My Model"]))
    assert drafter.snapshot_path == str(tmp_path / "home" / "drafter" / "org_My_Model.snapshot")
    off, _, _ = serve.configs_from_args(parse([model_dir, "--snapshot-path", ""]))
    assert off.snapshot_path == ""


def test_the_drafter_limits_reach_the_drafter_process(model_dir):
    drafter, _, _ = serve.configs_from_args(parse([
        model_dir, "--max-sessions", "7", "--max-session-tokens", "4096", "--max-cached-tokens", "100000",
        "--share-tenants", "--speculative-config", '{"suffix_decoding_max_cached_requests": 5}']))
    assert (drafter.max_sessions, drafter.max_session_tokens, drafter.max_cached_tokens) == (7, 4096, 100000)
    assert drafter.share_tenants and drafter.max_cached_requests == 5
    argv = to_argv(drafter)
    assert argv[argv.index("--max-sessions") + 1] == "7"


def test_a_packaged_model_brings_its_tool_call_parser_unless_one_is_given(model_dir, monkeypatch):
    monkeypatch.delenv("SPECLANE_GATEWAY_TOOL_CALL_PARSER", raising=False)
    monkeypatch.setattr(serve, "resolve_model", lambda model: model_dir)
    _, _, qwen = serve.configs_from_args(parse(["qwen2.5-coder-0.5b-instruct"]))
    assert qwen.tool_call_parser == "json"  # its quantized checkpoint never writes <tool_call> tags
    _, _, given = serve.configs_from_args(parse(["qwen2.5-coder-0.5b-instruct", "--tool-call-parser", "hermes"]))
    assert given.tool_call_parser == "hermes"
    _, _, other = serve.configs_from_args(parse([model_dir]))
    assert other.tool_call_parser == "hermes"
