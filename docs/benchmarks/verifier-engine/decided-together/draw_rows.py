"""Milliseconds to draw a token from each of 64 rows of SmolLM2's 49,152 probabilities on a CPU: our kernel
(csrc/draw.cc, sampling.draw without a dtype) against the float64 cumulative sum and search (sampling.draw with
float64, an accelerator's way); one thread, medians of 30 alternated repeats.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/decided-together/draw_rows.py
"""

import statistics
import time

import torch

from verifier_service.sampling import draw

torch.set_num_threads(1)
torch.manual_seed(0)
probs = torch.softmax(torch.randn(64, 49152) * 3, -1)
uniforms = torch.rand(64)
times = {"kernel": [], "float64 cumsum": []}
for _ in range(30):
    for name, dtype in (("kernel", None), ("float64 cumsum", torch.float64)):
        started = time.perf_counter()
        draw(probs, uniforms, dtype)
        times[name].append(time.perf_counter() - started)
print({name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}, "ms for 64 rows of 49,152")
