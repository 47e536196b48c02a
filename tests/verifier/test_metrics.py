"""Per-pass metrics reach Prometheus; a full KV budget is RESOURCE_EXHAUSTED over gRPC."""

import asyncio

import grpc
import prometheus_client

from verifier_service.async_engine import AsyncEngine
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


def test_the_batch_window_waits_for_sequences_between_steps(runner):
    """B's step arrives shortly after A's: with a batch window, one pass takes both."""
    passes = []

    async def main():
        engine = AsyncEngine(lambda: make_engine(runner, on_step=passes.append), threads=1, batch_wait_seconds=5.0)
        await engine.start()
        params = GenerationParams(GREEDY, max_new_tokens=8, ignore_eos=True)
        a, b = engine.open("a", PROMPT, params), engine.open("b", PROMPT[::-1], params)
        await asyncio.gather(engine.prefill(a), engine.prefill(b))
        passes.clear()

        async def late_b():
            await asyncio.sleep(0.05)
            return await engine.verify(b, Draft())

        await asyncio.gather(engine.verify(a, Draft()), late_b())
        await engine.stop()

    asyncio.run(main())
    assert passes[-1].num_sequences == 2  # without the window, b would run alone after a
