"""Model ids as `vllm serve` takes them: org/name from the Hugging Face cache
(a real cache layout in tmp_path; no network in these tests), and ModelScope
ids with a clear error while its client is not installed."""

import importlib.util
import json

import pytest
from huggingface_hub import constants as hf_constants

from speclane.models import ModelNotFound, hub_model, resolve_model, served_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache ($HF_HOME/hub); the library reads its location at import."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    return cache


def cache_model(cache, repo_id: str, files: dict[str, str]):
    """Lays a snapshot out as huggingface_hub does: refs/main names the commit under snapshots/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_a_cached_hub_model_resolves_to_its_snapshot(hf_cache):
    snapshot = cache_model(hf_cache, "tiny-org/tiny-llama", {"config.json": json.dumps({"model_type": "llama"})})
    # Found in the cache whether or not fetching is allowed: no network involved.
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    assert resolve_model("tiny-org/tiny-llama", pull_if_missing=False) == snapshot
    assert served_name("tiny-org/tiny-llama") == "tiny-org/tiny-llama"


def test_a_missing_hub_model_is_not_fetched_when_pulling_is_off(hf_cache):
    with pytest.raises(ModelNotFound, match="speclane pull tiny-org/absent"):
        resolve_model("tiny-org/absent", pull_if_missing=False)


def test_hf_hub_offline_forbids_the_download(hf_cache, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        resolve_model("tiny-org/absent")


def test_a_cached_repository_without_config_is_no_model(hf_cache):
    cache_model(hf_cache, "tiny-org/dataset-like", {"README.md": "not a model"})
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model("tiny-org/dataset-like")


@pytest.mark.skipif(importlib.util.find_spec("modelscope") is not None, reason="the ModelScope client is installed")
@pytest.mark.parametrize("name, env", [("modelscope:qwen/Qwen2.5-0.5B-Instruct", None),
                                       ("qwen/Qwen2.5-0.5B-Instruct", "true")])
def test_modelscope_ids_need_its_client(hf_cache, monkeypatch, name, env):
    if env:
        monkeypatch.setenv("VLLM_USE_MODELSCOPE", env)
    with pytest.raises(ModelNotFound, match="pip install modelscope"):
        resolve_model(name)


def test_what_counts_as_a_hub_id(monkeypatch):
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    assert hub_model("Qwen/Qwen3-0.6B").modelscope is False
    assert hub_model("modelscope:Qwen/Qwen3-0.6B").repo_id == "Qwen/Qwen3-0.6B"
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "True")  # vLLM compares case-insensitively
    assert hub_model("Qwen/Qwen3-0.6B").modelscope is True
    for path in ("./models/x", "/abs/org/name", "~/org/name", "org/name/extra", "smollm2-135m-instruct"):
        assert hub_model(path) is None, path
