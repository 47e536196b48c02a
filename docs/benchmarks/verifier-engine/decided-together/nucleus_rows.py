"""Milliseconds a row for top-p's nucleus on a CPU: our kernel (csrc/nucleus.cc, through sampling._cpu_nucleus)
against the partial sort an accelerator tries first (torch.topk of 1,024) and the whole-row sort it falls back to,
over 21 rows of SmolLM2's 49,152 (a CPU group's worth, sampling.step_groups), nearly flat and trained-like, top-p
0.95, one thread; medians of 30 alternated repeats.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/decided-together/nucleus_rows.py
"""

import statistics
import time

import torch

from verifier_service import sampling

torch.set_num_threads(1)
torch.manual_seed(0)
for spread, name in ((0.1, "nearly flat"), (3.0, "trained-like")):
    probs = torch.softmax(torch.randn(21, 49152) * spread, -1)
    top_p = torch.full((21, 1), 0.95)
    ways = {"kernel": lambda probs=probs, top_p=top_p: sampling._cpu_nucleus(probs, top_p),
            "top-1024": lambda probs=probs: torch.topk(probs, 1024, dim=-1),
            "sort": lambda probs=probs: torch.sort(probs, dim=-1, descending=True)}
    times = {way: [] for way in ways}
    for _ in range(30):
        for way, run in ways.items():
            started = time.perf_counter()
            run()
            times[way].append(time.perf_counter() - started)
    print(name, {way: round(statistics.median(t) * 1e3 / len(probs), 3) for way, t in times.items()}, "ms a row")
