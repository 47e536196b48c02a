"""The verifier's entry point. On Linux the process first re-executes itself
with tcmalloc preloaded, as vLLM's CPU platform does: a pass makes thousands
of small tensor allocations, and with tcmalloc serving them SmolLM2's decode
pass took 19.5 instead of 22.0 ms at one sequence and 77.8 instead of 82.2 ms
at 32 on this project's CPU (docs/benchmarks/verifier-engine). glibc's own
tunables (mmap and trim thresholds) did not help. An allocator already in
LD_PRELOAD is kept: the operator chose it."""

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
                "glibc (install libtcmalloc-minimal4 for about 10% faster CPU passes)")


def main(argv: list[str] | None = None, prog: str = "python -m verifier_service") -> None:
    environment = preload_environment(os.environ) if sys.platform == "linux" else None
    if environment is not None:
        # The same command line (`python -m verifier_service ...` or `speclane verifier ...`), before torch loads.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    from verifier_service.server import main as serve

    serve(argv, prog)
