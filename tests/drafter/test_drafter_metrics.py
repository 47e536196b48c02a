"""The drafter's Prometheus metrics: drafts and tokens per source (a miss under
"none"), a message's steps' times, and the core's sizes read at scrape time."""

import asyncio

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from drafter_service.engine import DraftEngine
from drafter_service.metrics import DrafterMetrics
from tests.drafter.test_drafter_service import REPEATED, drafter, run_session, start


def samples(metrics: DrafterMetrics) -> dict[tuple, float]:
    text = prometheus_client.generate_latest(metrics.registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_drafts_per_source_step_times_and_core_sizes():
    engine = DraftEngine(max_tree_depth=24, max_cached_requests=100)
    metrics = DrafterMetrics(engine.core)

    async def main():
        async with drafter(engine, metrics=metrics) as stub:
            await run_session(stub, start(REPEATED * 3, k=4), [[], [11, 12]])  # two hits of 4 tokens
            await run_session(stub, start([1, 2, 3]), [[]])  # nothing to match: a miss

    before = samples(metrics)
    asyncio.run(main())
    after = samples(metrics)
    assert after[("speclane:drafter_drafts_total", (("source", "suffix-request"),))] == 2
    assert after[("speclane:drafter_draft_tokens_total", (("source", "suffix-request"),))] == 8
    assert after[("speclane:drafter_drafts_total", (("source", "none"),))] == 1
    assert after[("speclane:drafter_batch_seconds_count", ())] == 3
    assert after[("speclane:drafter_sessions", ())] == 0
    assert after[("speclane:drafter_cached_requests", ())] == 1  # an empty response is not kept
    assert after[("speclane:drafter_cached_tokens", ())] == 2  # the first session's response
    assert after[("speclane:drafter_memory_bytes", ())] > 0
    assert before[("speclane:drafter_cached_tokens", ())] == 0  # read from the core at each scrape
