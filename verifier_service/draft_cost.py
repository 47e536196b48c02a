"""What one more draft token costs a verify step, measured on this verifier.
It decides how long a draft is worth verifying: on an accelerator a pass of
k+1 tokens costs about what a 1-token pass does (reading the weights
dominates), on a CPU every token adds compute, so a draft that pays on one
loses on the other. The gateway and the head both weigh drafts with it.

The cost also depends on the batch: a CPU pass over one sequence is bound by
reading the weights, over 32 by compute, where a draft token costs about what
another sequence's token does. So it is measured at a few batch sizes."""

import pathlib
import statistics
import time

import structlog

from verifier_service import tuning_cache
from verifier_service.sequence import Draft, GenerationParams

# Batch sizes measured at start-up, and how many times each (the fastest counts: the least noisy).
# About 3 s on a 2-core CPU for SmolLM2, most of it the 32 sequences' steps (twice at a first start).
BATCH_SIZES = ((1, 5), (8, 2), (32, 2))
MEASURED_CONTEXT = 16  # tokens per sequence: short, so the 32 prefills stay cheap
# Two measurements agree where their costs differ by at most this share of their mean, or this much (in plain
# steps): both runs of four on a quiet 2-core host did. Another process on the cores during one (a package build,
# a benchmark) made a cost four times its true value, which a stored cost would then have kept for every start.
AGREEMENT_SHARE, AGREEMENT_ABS = 0.25, 0.03

log = structlog.get_logger()


def measure_token_cost(engine, num_sequences: int = 1, num_draft_tokens: int = 4, repeats: int = 5,
                       context: int = 64) -> float:
    """(T(1 + n) - T(1)) / (n * T(1)): verify steps of `num_sequences` sequences
    with n draft tokens each against plain ones. It is also the chance of
    acceptance a draft token needs to pay for itself in such a batch: it costs
    (T(1 + n) - T(1)) / (n * B) and plain decoding commits B tokens per T(1)."""
    runner = engine.runner
    prompt = [(i * 7919) % runner.vocab_size for i in range(context)]
    steps = 2 * repeats * (num_draft_tokens + 1)
    params = GenerationParams(max_new_tokens=steps + 1, ignore_eos=True)
    batch = [engine.open(f"draft-cost-{i}", prompt, params) for i in range(num_sequences)]
    try:
        engine.run_together([(seq, Draft()) for seq in batch])
        plain, drafted = [], []
        for _ in range(repeats):
            for times, draft in ((plain, Draft()), (drafted, Draft(token_ids=(prompt[0],) * num_draft_tokens))):
                started = time.perf_counter()
                engine.run_together([(seq, draft) for seq in batch])
                times.append(time.perf_counter() - started)
    finally:
        for seq in batch:
            engine.close(seq)
    return round(max(0.0, (min(drafted) - min(plain)) / (num_draft_tokens * min(plain))), 3)


def measure_token_costs(engine) -> dict[int, float]:
    """The cost at each of BATCH_SIZES: batch size -> cost."""
    return {size: measure_token_cost(engine, size, repeats=repeats, context=MEASURED_CONTEXT)
            for size, repeats in BATCH_SIZES}


def stored_or_measured_token_costs(engine, key: dict, tuning_dir: pathlib.Path | None) -> tuple[dict[int, float], bool]:
    """The costs stored under `key` (what the engine's passes depend on beyond this code, whose
    hash joins it) by an earlier start, or measured now; and whether they were measured. Only
    costs that two measurements agree on, taken while the cores were quiet, are stored; where
    they disagree the median of three serves this start, and the next one measures again."""
    key = {**key, "code": tuning_cache.code_fingerprint(pathlib.Path(__file__).parent), "sizes": BATCH_SIZES,
           "context": MEASURED_CONTEXT}
    stored = tuning_cache.load(tuning_dir, "draft-token-costs", key)
    if stored is not None:
        return {int(size): cost for size, cost in stored.items()}, False
    with tuning_cache.CoreWatch() as watch:
        first, second = measure_token_costs(engine), measure_token_costs(engine)
    if agree(first, second):
        costs = {size: round((first[size] + second[size]) / 2, 3) for size in first}
        # A CPU verifier's tensor-parallel ranks share its cores, so there every start measures.
        tuning_cache.store_measured(tuning_dir, "draft-token-costs", key, costs, watch,
                                    on_host_cores=engine.runner.device.type == "cpu")
        return costs, True
    third = measure_token_costs(engine)
    costs = {size: statistics.median((first[size], second[size], third[size])) for size in first}
    log.warning("draft_token_cost_unsettled", measurements=[first, second, third], used=costs,
                reason="two measurements disagreed (another process on the cores?); not stored")
    return costs, True


def agree(first: dict[int, float], second: dict[int, float]) -> bool:
    """Whether two measurements of the costs by batch size are the same within their noise."""
    return all(abs(first[size] - second[size])
               <= max(AGREEMENT_ABS, AGREEMENT_SHARE * (first[size] + second[size]) / 2) for size in first)
