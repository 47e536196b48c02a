"""Configuration of the verifier service (flags, or SPECLANE_VERIFIER_* env vars)."""

import os
from dataclasses import dataclass

from speclane.config import option
from speclane.log import check_log_level
from verifier_service.device import DEVICE_PATTERN, DTYPES

ENV_PREFIX = "SPECLANE_VERIFIER_"


@dataclass(frozen=True)
class VerifierConfig:
    model: str = option("", "path to a Hugging Face causal-LM directory (safetensors); required")
    model_name: str = option("", "model name reported to clients; empty means the directory name")
    address: str = option("127.0.0.1:50062", "gRPC listen address host:port")
    device: str = option("auto", "auto, cpu, cuda[:N] or npu[:N] (npu needs torch_npu)")
    dtype: str = option("auto", "auto (fp32 on CPU, bf16 on NPU, bf16/fp16 on CUDA), float32, bfloat16 or float16")
    threads: int = option(0, "torch intra-op CPU threads; 0 means 1 (decode is memory-bound)")
    max_concurrent_rpcs: int = option(256, "concurrent RPCs before RESOURCE_EXHAUSTED")
    log_level: str = option("info", "debug, info, warning or error")

    def __post_init__(self):
        if not self.model:
            raise ValueError(f"model is required (--model or {ENV_PREFIX}MODEL)")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model {self.model!r} is not a Hugging Face model directory (no config.json)")
        if not self.model_name:
            # Frozen dataclass: fill the derived default once, at construction.
            object.__setattr__(self, "model_name", os.path.basename(os.path.normpath(self.model)))
        if not DEVICE_PATTERN.match(self.device):
            raise ValueError(f"device must be auto, cpu, cuda[:N] or npu[:N], got {self.device!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.max_concurrent_rpcs < 1:
            raise ValueError("max_concurrent_rpcs must be >= 1")
        check_log_level(self.log_level)
