"""Device, dtype and CPU-thread selection for the target model.

Ascend NPUs come through the optional `torch_npu` plugin. It is imported only
inside `resolve_device` (never at module level): importing it on a host
without CANN breaks torch. The importer and the CUDA module are parameters so
the selection logic is testable without either backend.
"""

import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from verifier_service.config import DEVICE_PATTERN, DTYPES


class DeviceError(RuntimeError):
    """The requested device does not exist on this host."""


def _import_npu(import_module: Callable[[str], ModuleType]) -> ModuleType | None:
    """torch_npu if it imports, else None (any failure means no usable NPU)."""
    try:
        return import_module("torch_npu")
    except Exception:  # noqa: BLE001 - a broken CANN install raises more than ImportError
        return None


def _with_index(kind: str, requested: str, backend) -> str:
    index = int(requested.split(":", 1)[1]) if ":" in requested else 0
    count = backend.device_count()
    if index >= count:
        raise DeviceError(f"{kind}:{index} requested but only {count} {kind} device(s) are visible")
    return f"{kind}:{index}"


def resolve_device(
    requested: str = "auto",
    *,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
    cuda=torch.cuda,
) -> str:
    """Maps "auto" | "cpu" | "cuda[:N]" | "npu[:N]" to a concrete device name.

    "auto" prefers CUDA, then an NPU (torch_npu importable and a device
    visible), then the CPU. Returns a string because "npu" is only a valid
    torch.device once torch_npu is imported.
    """
    if not DEVICE_PATTERN.match(requested):
        raise DeviceError(f"unknown device {requested!r}; use auto, cpu, cuda[:N] or npu[:N]")
    kind = requested.split(":", 1)[0]
    if kind == "cpu":
        return "cpu"
    if kind in ("auto", "cuda") and cuda.is_available():
        return _with_index("cuda", requested, cuda)
    if kind == "cuda":
        raise DeviceError("device cuda requested but CUDA is not available")
    torch_npu = _import_npu(import_module)
    npu_available = torch_npu is not None and torch_npu.npu.is_available()
    if npu_available:
        return _with_index("npu", requested, torch_npu.npu)
    if kind == "npu":
        reason = "torch_npu is not installed (or fails to import)" if torch_npu is None else "no NPU is visible"
        raise DeviceError(f"device npu requested but {reason}")
    return "cpu"


def resolve_dtype(requested: str, device: str, *, cuda=torch.cuda) -> torch.dtype:
    """"auto" is fp32 on CPU (bf16 is no faster there and shifts logits), bf16 on
    NPU, bf16 on CUDA when supported else fp16; otherwise the named dtype."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; use auto, {', '.join(DTYPES)}")
        return getattr(torch, requested)
    if device == "cpu":
        return torch.float32
    if device.startswith("npu"):
        return torch.bfloat16
    return torch.bfloat16 if cuda.is_bf16_supported() else torch.float16


def resolve_threads(threads: int) -> int:
    """0 means auto: one intra-op thread, since decode is memory-bound and a
    second OpenMP thread makes step latency explode on a busy small host."""
    return threads if threads > 0 else 1


def set_threads(threads: int) -> None:
    """Sets torch's intra-op threads; call before the first torch op of the process."""
    torch.set_num_threads(resolve_threads(threads))


def free_memory_bytes(device: str, *, meminfo_path: str = "/proc/meminfo") -> int:
    """Memory still available on the device (host RAM for the CPU)."""
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        with open(meminfo_path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no MemAvailable in {meminfo_path}")
    backend = getattr(torch, kind)  # torch.cuda, or torch.npu once torch_npu is imported
    return backend.mem_get_info(torch.device(device))[0]


def kv_budget_tokens(max_kv_tokens: int, memory_fraction: float, free_bytes: int, bytes_per_token: int) -> int:
    """The KV budget: `max_kv_tokens` if set, else that share of the free memory."""
    if max_kv_tokens:
        return max_kv_tokens
    return int(free_bytes * memory_fraction) // bytes_per_token
