"""The decisions of 64 sampled chains with proposals (k = 3, SmolLM2's vocabulary), by an older verify.py
(each chain by its own operations) and this tree's (all together), in one process, alternated: the decisions
must be equal; prints the operations torch dispatches and the median milliseconds of each.

    git worktree add /tmp/before <rev>
    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/heads/one-read-a-step/chain_decisions.py \
        /tmp/before/verifier_service/verify.py [steps per call, default 64]
"""

import importlib.util
import statistics
import sys
import time

import torch

import verifier_service.verify as new
from speclane_cli.bench.verifier import OperationCount

spec = importlib.util.spec_from_file_location("old_verify", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
torch.set_num_threads(1)
torch.manual_seed(0)
VOCAB, CHAINS, K = 49152, 64, 3
GROUP = int(sys.argv[2]) if len(sys.argv) > 2 else CHAINS  # the engine's CPU groups hold about 5 such steps
probs = torch.softmax(torch.randn(CHAINS * (K + 1), VOCAB), -1)
q = torch.softmax(torch.randn(CHAINS, K, VOCAB), -1)
drafts = [torch.randint(VOCAB, (K,)).tolist() for _ in range(CHAINS)]


def decide(module) -> list[int]:
    parts = []
    for start in range(0, CHAINS, GROUP):
        chains = range(start, min(CHAINS, start + GROUP))
        steps = [module.SampledStep(drafts[i], (i - start) * (K + 1), torch.Generator().manual_seed(i), q[i])
                 for i in chains]
        parts.append(module.sampled_decisions(probs[start * (K + 1): (chains[-1] + 1) * (K + 1)], steps))
    return torch.cat(parts).tolist()


assert decide(old) == decide(new)
for name, module in (("before", old), ("after", new)):
    with OperationCount() as counted:
        decide(module)
    print(name, "operations", counted.count)
times = {"before": [], "after": []}
for repeat in range(20):
    order = (("before", old), ("after", new)) if repeat % 2 else (("after", new), ("before", old))
    for name, module in order:
        started = time.perf_counter()
        decide(module)
        times[name].append(time.perf_counter() - started)
print({name: round(statistics.median(values) * 1e3, 2) for name, values in times.items()})
