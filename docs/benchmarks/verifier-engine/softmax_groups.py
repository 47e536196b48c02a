"""Why a CPU computes target probabilities in groups of rows (sampling.CPU_GROUP_BYTES): the temperature and
softmax over the 256 rows of a 64-sequence, 3-token verify pass with SmolLM2's vocabulary, at once and in groups,
one thread, medians of 10.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/softmax_groups.py
"""

import statistics
import time

import torch

ROWS, VOCAB = 256, 49_152


def run(logits: torch.Tensor, temperature: torch.Tensor, group: int) -> None:
    for first in range(0, ROWS, group):
        torch.softmax(logits[first:first + group] / temperature[first:first + group], dim=-1)


def main() -> None:
    torch.set_num_threads(1)
    logits = torch.randn(ROWS, VOCAB)
    temperature = torch.full((ROWS, 1), 0.8)
    for group in (ROWS, 64, 16, 4, 1):
        run(logits, temperature, group)
        times = []
        for _ in range(10):
            started = time.perf_counter()
            run(logits, temperature, group)
            times.append(time.perf_counter() - started)
        print(f"groups of {group:>3} rows ({group * VOCAB * 4 / 2**20:5.2f} MB): "
              f"{statistics.median(times) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
