"""The sampled decisions of 64 sequences (SmolLM2's vocabulary) by an older verify.py and this tree's, in one
process, alternated: trees of 16 nodes (EAGLE's top-3 shape, 3 levels) and chains of 3 tokens, each by
sequences seeded (their own generators; the two must decide alike, bit for bit) and unseeded (before, each
sequence had its own generator all the same; now they share the engine's). Prints the operations torch
dispatches (each a kernel launch on an accelerator) and the median milliseconds, all the steps at once (as on an
accelerator) and in the engine's CPU groups (sampling.step_groups).

    git worktree add /tmp/before <rev>
    flock /tmp/speclane-bench.lock .venv/bin/python \
        docs/benchmarks/verifier-engine/decided-together/sampled_decisions.py /tmp/before/verifier_service/verify.py
"""

import importlib.util
import json
import statistics
import sys
import time

import torch

import verifier_service.verify as new
from speclane_cli.bench.verifier import OperationCount
from verifier_service.sampling import step_groups

spec = importlib.util.spec_from_file_location("old_verify", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
torch.set_num_threads(1)
torch.manual_seed(0)
VOCAB, SEQS = 49152, 64
SHAPES = {"tree": (-1, -1, -1, 0, 0, 0, 1, 1, 2, 3, 3, 4, 6, 9, 10, 12), "chain": (-1, 0, 1)}


def decide(module, parents, drafts, probs, generators, grouped) -> list:
    """The steps' verdicts, each group's decisions read with one copy to the host."""
    rows = len(parents) + 1
    groups = step_groups([rows] * SEQS, VOCAB, probs.device) if grouped else [range(SEQS)]
    verdicts = []
    for group in groups:
        steps = [module.SampledStep(drafts[i], (i - group[0]) * rows, generators[i], None, parents) for i in group]
        decided = module.sampled_decisions(probs[group[0] * rows: (group[-1] + 1) * rows], steps)
        verdicts += module.sampled_verdicts(steps, iter(decided.tolist()))
    return [(v.token_ids, v.num_accepted, v.path) for v in verdicts]


results = []
for shape, parents in SHAPES.items():
    probs = torch.softmax(torch.randn(SEQS * (len(parents) + 1), VOCAB) * 3, -1)
    drafts = [torch.randint(VOCAB, (len(parents),)).tolist() for _ in range(SEQS)]
    for grouped in (False, True):
        for seeded in (True, False):
            def generators(module, seeded=seeded):
                if seeded or module is old:
                    return [torch.Generator().manual_seed(i) for i in range(SEQS)]
                return [torch.Generator().manual_seed(0)] * SEQS

            if seeded:
                assert decide(old, parents, drafts, probs, generators(old), grouped) == \
                    decide(new, parents, drafts, probs, generators(new), grouped)
            row = {"draft": shape, "steps": "in CPU groups" if grouped else "at once", "seeded": seeded}
            for name, module in (("before", old), ("after", new)):
                with OperationCount() as counted:
                    decide(module, parents, drafts, probs, generators(module), grouped)
                row[f"operations_{name}"] = counted.count
            times = {"before": [], "after": []}
            for repeat in range(20):
                order = (("before", old), ("after", new)) if repeat % 2 else (("after", new), ("before", old))
                for name, module in order:
                    made = generators(module)
                    started = time.perf_counter()
                    decide(module, parents, drafts, probs, made, grouped)
                    times[name].append(time.perf_counter() - started)
            row.update({f"ms_{name}": round(statistics.median(values) * 1e3, 2) for name, values in times.items()})
            print(json.dumps(row), flush=True)
            results.append(row)
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, indent=1)
