"""tcmalloc for a service's process, as vLLM's CPU platform preloads it. On
Linux a service re-executes itself once, before its heavy imports, with
tcmalloc in LD_PRELOAD: the verifier's passes make thousands of small tensor
allocations (SmolLM2's decode pass took 19.5 instead of 22.0 ms at one
sequence, docs/benchmarks/verifier-engine), and the drafter's suffix trees and
protobuf messages make as many small ones (docs/benchmarks/drafter-service).
glibc's own tunables (mmap and trim thresholds) did not help. An allocator
already in LD_PRELOAD is kept: the operator chose it."""

import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping

_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def preload_environment(environ: Mapping[str, str],
                        find_library: Callable[[str], str | None] = ctypes.util.find_library) -> dict | None:
    """The environment to re-execute in so that tcmalloc serves malloc; None where
    LD_PRELOAD names an allocator already or no tcmalloc is installed."""
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in _ALLOCATORS):
        return None
    library = find_library("tcmalloc_minimal") or find_library("tcmalloc")
    if library is None:
        return None
    return {**environ, "LD_PRELOAD": ":".join(filter(None, (library, preload)))}


def allocator(environ: Mapping[str, str]) -> str:
    """The allocator this process runs with, for its start-up log."""
    preload = environ.get("LD_PRELOAD", "")
    return next((name for name in _ALLOCATORS if name in preload),
                "glibc (install libtcmalloc-minimal4 for a faster verifier and drafter)")


def reexecute_with_tcmalloc() -> None:
    """Re-executes this process's command line (`python -m verifier_service ...`, `speclane drafter ...`)
    with tcmalloc preloaded, where it is installed and no allocator is preloaded; returns otherwise."""
    environment = preload_environment(os.environ) if sys.platform == "linux" else None
    if environment is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
