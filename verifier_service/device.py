"""Device, dtype and CPU-thread selection for the target model.

Ascend NPUs come through the optional `torch_npu` plugin. It is imported only
inside `resolve_device` (never at module level): importing it on a host
without CANN breaks torch. The importer and the CUDA module are parameters so
the selection logic is testable without either backend.
"""

import ctypes
import functools
import importlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch.distributed.tensor import DTensor

from verifier_service.config import DEVICE_PATTERN, DTYPES, HEAD_INT8


class DeviceError(RuntimeError):
    """The requested device does not exist on this host."""


@functools.cache
def cpu_kernels() -> ModuleType:
    """Our C++ CPU kernels (csrc/, built by `make install`), imported where a CPU pass first uses them: a GPU or
    NPU host runs without building them. Cached: every CPU pass calls it per layer."""
    try:
        return importlib.import_module("verifier_service._cpu_kernels")
    except ImportError as missing:
        raise ImportError("verifier_service._cpu_kernels is not built: run `make install` "
                          "(or `pip install -e .`) on this host") from missing


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


# vllm-ascend decodes at most 16 tokens per sequence a round (its attention and graph capture sizes): a
# step's token and 15 draft tokens.
NPU_MAX_DRAFT_TOKENS = 15


def draft_limit(device: str) -> int:
    """Draft tokens a sequence's step may verify on `device` (0: no limit of the device's)."""
    return NPU_MAX_DRAFT_TOKENS if device.startswith("npu") else 0


def resolve_dtype(requested: str, device: str, *, cpu_bf16: bool = False, cuda=torch.cuda) -> torch.dtype:
    """"auto" is bf16 on a CPU where `cpu_bf16` (auto_cpu_bf16) else fp32, bf16
    on NPU, bf16 on CUDA when supported else fp16; otherwise the named dtype."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; use auto, {', '.join(DTYPES)}")
        return getattr(torch, requested)
    if device == "cpu":
        return torch.bfloat16 if cpu_bf16 else torch.float32
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


def auto_cpu_bf16(native_bf16: bool, tensor_parallel_size: int, batch_invariant: str, attention_backend: str) -> bool:
    """Whether --dtype auto serves bf16 on a CPU, as vLLM's auto does: where the CPU multiplies bf16 natively
    (elsewhere torch widens it to fp32 first and it saves no time) and the passes can be batch-invariant, so
    that speculation never changes a greedy output (batch_invariant.py): one rank (tensor parallelism's
    reductions are not covered), the mode not switched off, the attention backend not named. A model whose
    bf16 passes fail the start-up check is then served in fp32 (workers.Rank0.load)."""
    return native_bf16 and tensor_parallel_size == 1 and batch_invariant != "off" and attention_backend == "auto"


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


def available_cores() -> int:
    """The cores this process may run on (its affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0))


def resolve_threads(threads: int, ranks_here: int = 1, cores: int | None = None) -> int:
    """0 means auto: the cores this process may use, shared among the ranks on this
    host. Measured on a 2-core host: 2 threads served SmolLM2 25% faster than 1
    at one request and 53% faster with 15 in flight."""
    if threads > 0:
        return threads
    return max(1, (available_cores() if cores is None else cores) // ranks_here)


def set_threads(threads: int, ranks_here: int = 1) -> None:
    """Sets torch's intra-op threads; call before the first torch op of the process."""
    torch.set_num_threads(resolve_threads(threads, ranks_here))


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


def release_freed_memory() -> None:
    """Hands memory freed at load (the weights our CPU kernels keep only packed) back to the OS: tcmalloc and
    glibc keep freed pages for the process's own reuse, and the host would go on counting them as ours. A no-op
    where the process's allocator offers neither call."""
    process = ctypes.CDLL(None)
    if hasattr(process, "MallocExtension_ReleaseFreeMemory"):  # tcmalloc, which the services preload
        process.MallocExtension_ReleaseFreeMemory()
    elif hasattr(process, "malloc_trim"):  # glibc
        process.malloc_trim(0)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters and buffers (its shard under tensor parallelism)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


_GIB = 1 << 30


@dataclass(frozen=True)
class Memory:
    """What sizes the KV cache, measured on one rank after the model loaded."""

    total_bytes: int
    free_bytes: int
    weights_bytes: int
    activation_bytes: int = 0  # the profiled peak of a full pass (accelerators)


def kv_cache_blocks(*, accelerator: bool, block_bytes: int, memory: Memory, gpu_memory_utilization: float,
                    kv_cache_space_gib: float, num_blocks_override: int = 0, state_bytes: int = 0) -> int:
    """KV blocks, as vLLM sizes them: on an accelerator, `gpu_memory_utilization`
    of its total memory less the weights and the activations' peak; on a CPU,
    `kv_cache_space_gib`; either less the linear-attention states (`state_bytes`).
    Refuses (ValueError) memory that is not there."""
    if num_blocks_override:
        return num_blocks_override
    if accelerator:
        allowed = int(memory.total_bytes * gpu_memory_utilization)
        kv_bytes = allowed - memory.weights_bytes - memory.activation_bytes
        if kv_bytes < block_bytes:
            raise ValueError(f"--gpu-memory-utilization {gpu_memory_utilization} allows {allowed / _GIB:.2f} GiB of "
                             f"{memory.total_bytes / _GIB:.2f} GiB, but the weights take "
                             f"{memory.weights_bytes / _GIB:.2f} GiB and a pass's activations "
                             f"{memory.activation_bytes / _GIB:.2f} GiB, leaving no KV cache; raise it")
        if kv_bytes > memory.free_bytes:
            # As vLLM refuses to start: memory that other processes hold is not ours to plan with.
            raise ValueError(f"--gpu-memory-utilization {gpu_memory_utilization} leaves {kv_bytes / _GIB:.2f} GiB "
                             f"for the KV cache, but only {memory.free_bytes / _GIB:.2f} GiB is free; "
                             "lower it or free memory")
    else:
        kv_bytes = int(kv_cache_space_gib * _GIB)
        if kv_bytes > memory.free_bytes:
            raise ValueError(f"--kv-cache-space {kv_cache_space_gib:g} GiB is more than the "
                             f"{memory.free_bytes / _GIB:.2f} GiB of memory available; lower it")
    kv_bytes -= state_bytes
    if kv_bytes < block_bytes:
        raise ValueError("the KV cache space holds less than one block" +
                         (f" after {state_bytes / _GIB:.2f} GiB of linear-attention states" if state_bytes else ""))
    return kv_bytes // block_bytes
