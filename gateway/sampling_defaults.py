"""What a request samples with when it leaves temperature, top_p or top_k out:
the model's generation_config.json where it says, else temperature 1.0 (as
OpenAI and vLLM do; vLLM's `--generation-config vllm` ignores the file)."""

import json
import pathlib
from dataclasses import dataclass

GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None


def read_sampling_defaults(model_dir: str | pathlib.Path, mode: str = "auto") -> SamplingDefaults:
    path = pathlib.Path(model_dir) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return SamplingDefaults()
    config = json.loads(path.read_text())
    return SamplingDefaults(
        temperature=float(config.get("temperature", 1.0)),
        top_p=config.get("top_p"),
        top_k=config.get("top_k") or None,  # 0 means off
    )
