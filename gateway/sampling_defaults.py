"""What a request samples with when it leaves a setting out: the model's
generation_config.json where it says, else OpenAI's and vLLM's neutral values
(temperature 1.0, no penalty). The settings read are vLLM's: temperature,
top_p, top_k, repetition_penalty, min_p, and max_new_tokens as the default
max_tokens (vLLM's `--generation-config vllm` ignores the file)."""

import json
import pathlib
from dataclasses import dataclass

GENERATION_CONFIG_MODES = ("auto", "vllm")
MAX_REPETITION_PENALTY = 2.0  # vLLM's bound


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = None  # None: what the context leaves


def read_sampling_defaults(model_dir: str | pathlib.Path, mode: str = "auto") -> SamplingDefaults:
    """Raises ValueError, naming the file, for a setting no request could be given."""
    path = pathlib.Path(model_dir) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return SamplingDefaults()
    config = json.loads(path.read_text())
    defaults = SamplingDefaults(
        temperature=float(config.get("temperature", 1.0)),
        top_p=config.get("top_p"),
        top_k=config.get("top_k") or None,  # 0 means off
        repetition_penalty=float(config.get("repetition_penalty", 1.0)),
        min_p=float(config.get("min_p", 0.0)),
        max_tokens=config.get("max_new_tokens"),
    )
    if not (0 <= defaults.temperature and 0 < defaults.repetition_penalty <= MAX_REPETITION_PENALTY
            and 0 <= defaults.min_p <= 1 and (defaults.top_p is None or 0 < defaults.top_p <= 1)
            and (defaults.max_tokens is None or defaults.max_tokens >= 1)):
        raise ValueError(f"{path}: a sampling setting is out of range ({defaults}); use --generation-config vllm "
                         "to ignore the file")
    return defaults
