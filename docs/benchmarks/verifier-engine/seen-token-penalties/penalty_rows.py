"""A pass's repetition penalty on a CPU in its two forms, in one process, alternated: the dense table
(`TokenCounts`, an accelerator's form) and the seen tokens (`SeenTokenCounts`, a CPU's since 2026-11-29).
64 sequences, SmolLM2's vocabulary (49,152), repetition penalty 1.05 (Qwen2.5's default), prompts of 64, 2,048
and 8,192 tokens drawn from a Zipf law (their distinct tokens are reported), each pass one more output token a
sequence; no draft, a chain of 3 and a tree of 6. Median ms of `apply_logit_controls` over a pass's rows, in the
engine's groups of at most 4 MB of rows; the first pass, which builds a sequence's seen tokens from its prompt
(or fills its dense row), apart. Run with the verifier's glibc thresholds, as the engine runs:

    MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_TOP_PAD_=67108864 \\
    flock /tmp/speclane-bench.lock .venv/bin/python \\
    docs/benchmarks/verifier-engine/seen-token-penalties/penalty_rows.py
"""

import json
import statistics
import time

import numpy as np
import torch

from protos.conventions import chain_parents
from verifier_service.logits_processing import ControlledStep, apply_logit_controls, make_logits_processor
from verifier_service.penalties import SeenTokenCounts, TokenCounts
from verifier_service.sampling import SamplingParams, step_groups

VOCAB, SEQUENCES, PASSES = 49_152, 64, 15
DRAFTS = {"none": (), "chain of 3": chain_parents(3), "tree of 6": (-1, -1, 0, 0, 1, 1)}
FORMS = {"dense": lambda: TokenCounts(VOCAB, torch.device("cpu")), "seen tokens": SeenTokenCounts}


def main() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    params = SamplingParams(repetition_penalty=1.05)
    for prompt_len in (64, 2048, 8192):
        prompts = [(rng.zipf(1.3, prompt_len) % VOCAB).tolist() for _ in range(SEQUENCES)]
        distinct = statistics.median(len(set(prompt)) for prompt in prompts)
        for draft_name, parents in DRAFTS.items():
            processors = {name: [make_logits_processor(params, prompt_len, frozenset(), table())
                                 for _ in prompts] for name, table in FORMS.items()}
            outputs = [[] for _ in prompts]
            first = {name: 0.0 for name in FORMS}
            times = {name: [] for name in FORMS}
            width = len(parents) + 1
            rows = torch.randn(SEQUENCES * width, VOCAB)
            groups = step_groups([width] * SEQUENCES, VOCAB, torch.device("cpu"))
            for step in range(PASSES + 1):
                for output in outputs:
                    output.append(int(rng.integers(VOCAB)))
                draft = [int(t) for t in rng.integers(VOCAB, size=len(parents))]
                for name in (FORMS if step % 2 else reversed(FORMS)):  # alternated
                    elapsed = 0.0
                    for group in groups:  # as the engine processes them, a group's rows at once
                        steps = [ControlledStep(j * width, processors[name][i], [*prompts[i], *outputs[i]], draft,
                                                parents) for j, i in enumerate(group)]
                        logits = rows[:len(group) * width].clone()
                        started = time.perf_counter()
                        apply_logit_controls(logits, steps)
                        elapsed += (time.perf_counter() - started) * 1e3
                    if step == 0:
                        first[name] = elapsed
                    else:
                        times[name].append(elapsed)
            row = {"prompt_tokens": prompt_len, "distinct_prompt_tokens": distinct, "draft": draft_name,
                   **{f"{name} first ms": round(first[name], 2) for name in FORMS},
                   **{f"{name} ms": round(statistics.median(times[name]), 2) for name in FORMS}}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
