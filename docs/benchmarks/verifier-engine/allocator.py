"""SmolLM2-135M's decode pass (the engine in process, 300-token contexts, the host's threads) under
glibc's malloc, tcmalloc, and glibc with its mmap and trim thresholds raised; a child process per
measurement, the configurations interleaved in rounds. Prints each step's median in ms.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/allocator.py
"""

import ctypes.util
import os
import re
import statistics
import subprocess
import sys

MODEL = os.path.expanduser("~/.cache/speclane/models/smollm2-135m-instruct")
ROUNDS = 4
SIZES = {1: 200, 32: 60}  # sequences -> decode steps timed


def decode_step_ms(size: int, steps: int, cache_bytes: int = 0, context_spread: int = 0,
                   draft_tokens: int = 0) -> float:
    """The mean decode step of `size` sequences of 300 + context_spread x i tokens (the engine in process), with
    a cache of `cache_bytes` (0: 64 blocks a sequence), each step verifying a chain of `draft_tokens` a sequence
    (rejected at once: one token committed a step). decode_ab.py times its trees with this too."""
    import time

    import torch

    from verifier_service.block_manager import BlockManager
    from verifier_service.device import set_threads
    from verifier_service.engine import Engine
    from verifier_service.model_runner import ModelRunner
    from verifier_service.scheduler import BatchLimits
    from verifier_service.sequence import Draft, GenerationParams

    def draft() -> Draft:
        return Draft(token_ids=[5] * draft_tokens) if draft_tokens else Draft()

    set_threads(0)
    runner = ModelRunner(MODEL, "cpu", torch.float32)
    num_blocks = cache_bytes // (runner.kv_bytes_per_token * 16) if cache_bytes else size * 64
    engine = Engine(runner, BlockManager(num_blocks, 16, False),
                    BatchLimits(max_tokens=4096, max_sequences=size, max_queue_wait=3600))
    params = GenerationParams(max_new_tokens=steps + 8, ignore_eos=True)
    seqs = [engine.open(f"s{i}", [(i * 97 + j * 13) % 40000 + 100 for j in range(300 + context_spread * i)], params)
            for i in range(size)]
    for _ in range(3):
        engine.run_together([(seq, Draft()) for seq in seqs])
    started = time.perf_counter()
    for _ in range(steps):
        engine.run_together([(seq, draft()) for seq in seqs])
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    configs = {"glibc": {}, "tcmalloc": {"LD_PRELOAD": tcmalloc},
               "glibc, thresholds raised": {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                                            "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}}
    times = {(size, name): [] for size in SIZES for name in configs}
    for _ in range(ROUNDS):
        for size, steps in SIZES.items():
            for name, env in configs.items():
                done = subprocess.run([sys.executable, __file__, "--child", str(size), str(steps)],
                                      env={**os.environ, **env}, capture_output=True, text=True, check=True)
                times[size, name].append(float(re.search(r"step_ms ([\d.]+)", done.stdout)[1]))
    print("| sequences | allocator | step ms, each round | median |\n|---|---|---|---|")
    for (size, name), values in times.items():
        print(f"| {size} | {name} | {' / '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(f"step_ms {decode_step_ms(int(sys.argv[2]), int(sys.argv[3])):.2f}")
    else:
        main()
