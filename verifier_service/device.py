"""Device, dtype and CPU-thread selection for the target model.

Ascend NPUs come through the optional `torch_npu` plugin. It is imported only
inside `resolve_device` (never at module level): importing it on a host
without CANN breaks torch. The importer and the CUDA module are parameters so
the selection logic is testable without either backend.
"""

import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch.distributed.tensor import DTensor

from verifier_service.config import DEVICE_PATTERN, DTYPES, HEAD_INT8


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
    """"auto" is fp32 on CPU (bf16 is faster on CPUs with AVX512-BF16, but its
    multi-token passes round differently from one-token steps, so speculation
    would change greedy outputs: docs/bench/bf16), bf16 on NPU, bf16 on CUDA
    when supported else fp16; otherwise the named dtype."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; use auto, {', '.join(DTYPES)}")
        return getattr(torch, requested)
    if device == "cpu":
        return torch.float32
    if device.startswith("npu"):
        return torch.bfloat16
    return torch.bfloat16 if cuda.is_bf16_supported() else torch.float16


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX); without it
    torch widens bf16 to fp32 first, and bf16 weights save no time."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class HeadPrecision:
    dtype: torch.dtype  # the head's activations and float weights
    int8_weights: bool = False  # its linear layers' weights in int8 (heads/int8.py)

    @property
    def name(self) -> str:
        """As --head-dtype names it."""
        return HEAD_INT8 if self.int8_weights else str(self.dtype).removeprefix("torch.")


def resolve_head_precision(requested: str, device: str, target_dtype: torch.dtype, *,
                           native_bf16: Callable[[], bool] = cpu_has_native_bf16) -> HeadPrecision:
    """The draft head's precision. "auto": int8 weights over bf16 on a CPU that
    multiplies bf16 natively, else the target's dtype. A head's steps are one
    row each, bound by reading its weights, which int8 quarters against fp32;
    the head only proposes, and the target verifies in its own dtype, so this
    never changes the output. "int8" runs on a CPU only (torch's kernel)."""
    if requested == HEAD_INT8 or (requested == "auto" and device == "cpu" and native_bf16()):
        if device != "cpu":
            raise ValueError(f"head_dtype int8 runs on a CPU only, not on {device}; use auto or a float dtype")
        return HeadPrecision(torch.bfloat16, int8_weights=True)
    return HeadPrecision(target_dtype if requested == "auto" else resolve_dtype(requested, device))


def resolve_threads(threads: int) -> int:
    """0 means auto: one intra-op thread, since decode is memory-bound and a
    second OpenMP thread makes step latency explode on a busy small host."""
    return threads if threads > 0 else 1


def set_threads(threads: int) -> None:
    """Sets torch's intra-op threads; call before the first torch op of the process."""
    torch.set_num_threads(resolve_threads(threads))


def _meminfo_bytes(name: str, meminfo_path: str) -> int:
    with open(meminfo_path) as meminfo:
        for line in meminfo:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} in {meminfo_path}")


def _mem_get_info(device: str) -> tuple[int, int]:
    backend = getattr(torch, device.split(":", 1)[0])  # torch.cuda, or torch.npu once torch_npu is imported
    return backend.mem_get_info(torch.device(device))


def free_memory_bytes(device: str, *, meminfo_path: str = "/proc/meminfo") -> int:
    """Memory still available on the device (host RAM for the CPU)."""
    if device.startswith("cpu"):
        return _meminfo_bytes("MemAvailable", meminfo_path)
    return _mem_get_info(device)[0]


def total_memory_bytes(device: str, *, meminfo_path: str = "/proc/meminfo") -> int:
    """The device's whole memory (host RAM for the CPU)."""
    if device.startswith("cpu"):
        return _meminfo_bytes("MemTotal", meminfo_path)
    return _mem_get_info(device)[1]


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters and buffers (its shard under tensor parallelism)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


_GIB = 1 << 30


def kv_budget_tokens(max_kv_tokens: int, memory_fraction: float, free_bytes: int, bytes_per_token: int, *,
                     gpu_memory_utilization: float = 0.0, total_bytes: int = 0, weights_bytes: int = 0) -> int:
    """The KV budget: `max_kv_tokens` if set; else, given `gpu_memory_utilization`
    (vLLM's meaning: the share of the device's total memory the engine may use,
    weights included), that share less the weights; else `memory_fraction` of
    the memory free after loading the weights. Memory figures are measured after
    loading."""
    if max_kv_tokens:
        return max_kv_tokens
    if not gpu_memory_utilization:
        return int(free_bytes * memory_fraction) // bytes_per_token
    allowed = int(total_bytes * gpu_memory_utilization)
    kv_bytes = allowed - weights_bytes
    if kv_bytes <= 0:
        raise ValueError(f"--gpu-memory-utilization {gpu_memory_utilization} allows {allowed / _GIB:.2f} GiB of "
                         f"{total_bytes / _GIB:.2f} GiB, but the weights alone take {weights_bytes / _GIB:.2f} GiB; "
                         "raise it")
    if kv_bytes > free_bytes:
        # As vLLM refuses to start: memory that other processes hold is not ours to plan with.
        raise ValueError(f"--gpu-memory-utilization {gpu_memory_utilization} leaves {kv_bytes / _GIB:.2f} GiB for "
                         f"the KV cache, but only {free_bytes / _GIB:.2f} GiB is free after loading the weights; "
                         "lower it or free memory")
    return kv_bytes // bytes_per_token
