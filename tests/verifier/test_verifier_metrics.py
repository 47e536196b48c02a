"""Per-pass metrics reach Prometheus; a full KV budget is RESOURCE_EXHAUSTED over gRPC."""

import asyncio
import time

import grpc
import prometheus_client
import pytest

from verifier_service.async_engine import AsyncEngine, batch_window
from verifier_service.metrics import VerifierMetrics
from verifier_service.scheduler import BatchLimits
from verifier_service.sequence import Draft, GenerationParams

from .conftest import make_engine
from .test_engine import GREEDY, PROMPT
from .test_service import prefill, running_verifier, session_error, wait_serving


def sample(metrics: VerifierMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny"})


def test_each_pass_is_recorded(runner):
    metrics = VerifierMetrics("tiny")
    engine = make_engine(runner, on_step=metrics.observe)
    seqs = [engine.open(f"s{i}", PROMPT, GenerationParams(GREEDY, max_new_tokens=4)) for i in range(3)]
    boxes = [[] for _ in seqs]
    for seq, box in zip(seqs, boxes):
        engine.submit(seq, Draft(), box.append)
    engine.step()
    assert all(boxes)
    assert sample(metrics, "speclane:verifier_forward_passes_total") == 1
    assert sample(metrics, "speclane:verifier_batch_sequences_sum") == 3
    assert sample(metrics, "speclane:verifier_batch_tokens_sum") == 3 * len(PROMPT)
    assert sample(metrics, "speclane:verifier_queue_wait_seconds_count") == 3
    assert sample(metrics, "speclane:verifier_kv_used_tokens") == 3 * 16
    assert b"vllm:kv_cache_usage_perc" in prometheus_client.generate_latest(metrics.registry)


def test_a_full_budget_is_resource_exhausted(tiny_model_dir):
    async def main():
        limits = BatchLimits(max_queue_wait=0)
        async with running_verifier(tiny_model_dir, max_kv_tokens=16, limits=limits) as (channel, engine):
            await wait_serving(channel)
            error = await session_error(channel, prefill(prompt=list(range(4, 30))))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "budget" in error.details()
            assert await engine.num_live() == 0

    asyncio.run(main())


def _a_and_late_b_verify_together(load, batch_wait_seconds: float, b_delay: float) -> int:
    """Sequences a and b prefilled, then a's step and, `b_delay` later, b's: the
    sequences in the pass that ran b's step (the last)."""
    passes = []

    async def main():
        engine = AsyncEngine(lambda: load(passes.append), threads=1, batch_wait_seconds=batch_wait_seconds)
        await engine.start()
        params = GenerationParams(GREEDY, max_new_tokens=8, ignore_eos=True)
        a, b = engine.open("a", PROMPT, params), engine.open("b", PROMPT[::-1], params)
        await asyncio.gather(engine.prefill(a), engine.prefill(b))
        passes.clear()

        async def late_b():
            await asyncio.sleep(b_delay)
            return await engine.verify(b, Draft())

        await asyncio.gather(engine.verify(a, Draft()), late_b())
        await engine.stop()

    asyncio.run(main())
    return passes[-1].num_sequences


def test_the_batch_window_waits_for_sequences_between_steps(runner):
    """B's step arrives shortly after A's: with a batch window, one pass takes both."""
    def load(on_step):
        return make_engine(runner, on_step=on_step)

    assert _a_and_late_b_verify_together(load, batch_wait_seconds=5.0, b_delay=0.05) == 2
    assert _a_and_late_b_verify_together(load, batch_wait_seconds=0.0, b_delay=0.05) == 1  # 0: never waits


def test_after_a_long_pass_the_window_grows_to_a_share_of_it(runner):
    """Passes of 0.4 s: a step 20 ms late still joins the next one, though the window is 1 ms."""
    def load(on_step):
        engine = make_engine(runner, on_step=on_step)
        step = engine.step

        def slow_step():
            progressed = step()
            if progressed:
                time.sleep(0.4)
            return progressed

        engine.step = slow_step
        return engine

    assert _a_and_late_b_verify_together(load, batch_wait_seconds=0.001, b_delay=0.02) == 2
    assert batch_window(0.01, last_pass_seconds=0.05) == 0.01
    assert batch_window(0.01, last_pass_seconds=0.5) == pytest.approx(0.05)
    assert batch_window(0.0, last_pass_seconds=0.5) == 0.0
