"""tcmalloc for a service's process, as vLLM's CPU platform preloads it. On
Linux a service re-executes itself once, before its heavy imports, with
tcmalloc in LD_PRELOAD: the verifier's passes make thousands of small tensor
allocations (SmolLM2's decode pass took 19.5 instead of 22.0 ms at one
sequence, docs/benchmarks/verifier-engine), and the drafter's suffix trees and
protobuf messages make as many small ones (docs/benchmarks/drafter-service).
An allocator already in LD_PRELOAD is kept: the operator chose it. Where no
tcmalloc is installed the verifier re-executes with glibc's mmap and trim
thresholds raised instead: a pass's judging makes temporaries of megabytes,
which glibc otherwise maps and faults in afresh depending on its heap's state
(deciding 64 sampled chains with proposals took 22-70 ms from run to run under
glibc's defaults, 18-30 with the thresholds raised; docs/benchmarks/heads/README.md)."""

import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping

_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
# Blocks up to 64 MB come from the heap, and up to 256 MB of freed heap stays mapped for the next pass.
GLIBC_THRESHOLDS = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
                    "MALLOC_TOP_PAD_": str(64 << 20)}


def preload_environment(environ: Mapping[str, str],
                        find_library: Callable[[str], str | None] = ctypes.util.find_library,
                        glibc_thresholds: bool = False) -> dict | None:
    """The environment to re-execute in so that tcmalloc serves malloc, or else (with `glibc_thresholds`)
    glibc with GLIBC_THRESHOLDS; None where LD_PRELOAD names an allocator already, or glibc's thresholds are
    set, or there is nothing to change."""
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in _ALLOCATORS):
        return None
    library = find_library("tcmalloc_minimal") or find_library("tcmalloc")
    if library is not None:
        return {**environ, "LD_PRELOAD": ":".join(filter(None, (library, preload)))}
    if not glibc_thresholds or any(name in environ for name in GLIBC_THRESHOLDS):
        return None
    return {**environ, **GLIBC_THRESHOLDS}


def allocator(environ: Mapping[str, str]) -> str:
    """The allocator this process runs with, for its start-up log."""
    preload = environ.get("LD_PRELOAD", "")
    thresholds = ", its thresholds raised" if "MALLOC_MMAP_THRESHOLD_" in environ else ""
    return next((name for name in _ALLOCATORS if name in preload),
                f"glibc{thresholds} (install libtcmalloc-minimal4 for a faster verifier and drafter)")


def reexecute_with_tcmalloc(glibc_thresholds: bool = False) -> None:
    """Re-executes this process's command line (`python -m verifier_service ...`, `speclane drafter ...`)
    with tcmalloc preloaded, where it is installed and no allocator is preloaded, or else with glibc's
    thresholds raised where `glibc_thresholds` asks; returns otherwise."""
    environment = preload_environment(os.environ, glibc_thresholds=glibc_thresholds) if sys.platform == "linux" \
        else None
    if environment is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
