"""What the verifier tells about its load and timings: preemption and prefix
cache counters (engine, Prometheus, GetLoad over gRPC), the queue and prefill
times on the prefill answer, the KV budget under --gpu-memory-utilization,
and --seed."""

import asyncio
import random

import grpc
import pytest
import torch

from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.device import Memory, free_memory_bytes, kv_cache_blocks, total_memory_bytes, weights_bytes
from verifier_service.metrics import VerifierMetrics
from verifier_service.sequence import Draft, GenerationParams
from verifier_service.server import seed_everything

from .conftest import make_engine
from .test_engine import GREEDY, PROMPT
from .test_service import prefill, running_verifier, wait_serving

GIB = 1 << 30


def metric(metrics: VerifierMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny"})


def run_to_end(engine, seq, draft=Draft()) -> None:
    engine.prefill(seq)
    while not seq.finished:
        engine.verify(seq, draft)


def test_prefix_cache_lookups_are_counted_in_tokens(runner):
    metrics = VerifierMetrics("tiny")
    engine = make_engine(runner, prefix_caching=True, on_step=metrics.observe)
    params = GenerationParams(GREEDY, max_new_tokens=6, ignore_eos=True)
    first_prompt = [(3 * i) % 60 + 4 for i in range(40)]
    turn1 = engine.open("t1", first_prompt, params)
    run_to_end(engine, turn1)
    turn2 = engine.open("t2", turn1.tokens + [9, 10, 11], params)
    engine.prefill(turn2)
    reused = turn2.num_cached - 1  # the KV the second turn took over (all but the token the pass just ran)
    assert reused >= 32  # at least two 16-token blocks
    assert engine.blocks.prefix_cache_queries == len(first_prompt) + len(turn2.tokens) - 1
    assert engine.blocks.prefix_cache_hits > 0
    assert metric(metrics, "vllm:prefix_cache_queries_total") == engine.blocks.prefix_cache_queries
    assert metric(metrics, "vllm:prefix_cache_hits_total") == engine.blocks.prefix_cache_hits


def test_without_prefix_caching_nothing_is_looked_up(runner):
    engine = make_engine(runner, prefix_caching=False)
    run_to_end(engine, engine.open("a", PROMPT, GenerationParams(GREEDY, max_new_tokens=3, ignore_eos=True)))
    assert engine.blocks.prefix_cache_queries == engine.blocks.prefix_cache_hits == 0


def grow_two_until_one_is_preempted(engine) -> list:
    """Two sequences admitted together (one block each, in a six-block pool) that
    each grow to four blocks: the later one is preempted so the other can grow."""
    params = GenerationParams(GREEDY, max_new_tokens=40, ignore_eos=True)
    seqs = [engine.open(f"s{i}", [(i * 7 + j) % 60 + 4 for j in range(16)], params) for i in range(2)]
    boxes = [[], []]
    for seq, box in zip(seqs, boxes):
        engine.submit(seq, Draft(), box.append)
    while not all(s.finished for s in seqs):
        engine.step()
        for seq, box in zip(seqs, boxes):
            if box and not seq.finished:
                box.clear()
                engine.submit(seq, Draft(), box.append)
    assert engine.scheduler.num_preemptions >= 1
    return seqs


def test_preemptions_are_counted(runner):
    metrics = VerifierMetrics("tiny")
    engine = make_engine(runner, max_kv_tokens=96, on_step=metrics.observe)
    grow_two_until_one_is_preempted(engine)
    assert metric(metrics, "vllm:num_preemptions_total") == engine.scheduler.num_preemptions


def test_a_preempted_sequence_reports_the_cache_hits_of_its_first_admission(runner):
    """Prefilled again from its own blocks, still in the prefix cache: that is no hit of its prompt's."""
    engine = make_engine(runner, max_kv_tokens=96, prefix_caching=True)
    seqs = grow_two_until_one_is_preempted(engine)
    assert engine.blocks.prefix_cache_hits > 0
    assert [seq.num_cached_prompt_tokens for seq in seqs] == [0, 0]


def test_get_load_and_the_prefill_timings_over_grpc(tiny_model_dir):
    async def main():
        async with running_verifier(tiny_model_dir, prefix_caching=True) as (channel, _):
            await wait_serving(channel)
            stub = verifier_pb2_grpc.VerifierStub(channel)
            idle = await stub.GetLoad(verifier_pb2.GetLoadRequest(), timeout=5)
            assert (idle.num_running, idle.num_waiting, idle.kv_used_tokens) == (0, 0, 0)
            assert idle.kv_max_tokens == 4096
            call = stub.Session()
            await call.write(prefill())
            first = await call.read()
            assert first.HasField("queue_seconds") and first.HasField("prefill_seconds")
            assert 0 <= first.queue_seconds < 5 and 0 < first.prefill_seconds < 5
            busy = await stub.GetLoad(verifier_pb2.GetLoadRequest(), timeout=5)
            assert busy.num_running == 1 and busy.kv_used_tokens >= len(PROMPT)
            assert busy.prefix_cache_queries == len(PROMPT) and busy.prefix_cache_hits == 0
            await call.write(verifier_pb2.SessionRequest(verify=verifier_pb2.Verify()))
            step = await call.read()
            assert not step.HasField("queue_seconds")  # the prefill answer's only
            assert 0 < step.forward_seconds <= step.step_seconds < 5  # the verifier's own share of the step
            call.cancel()

    asyncio.run(main())


def test_get_load_while_loading_is_unavailable(tiny_model_dir):
    async def main():
        warm = asyncio.Event()
        async with running_verifier(tiny_model_dir, warm=warm) as (channel, _):
            with pytest.raises(grpc.aio.AioRpcError) as loading:
                await verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=5)
            assert loading.value.code() == grpc.StatusCode.UNAVAILABLE
            warm.set()

    asyncio.run(main())


def blocks(memory: Memory, accelerator: bool = True, **flags) -> int:
    return kv_cache_blocks(accelerator=accelerator, block_bytes=GIB // 1024,
                           **{"memory": memory, "gpu_memory_utilization": 0.9, "kv_cache_space_gib": 4, **flags})


def test_the_kv_cache_is_sized_as_vllm_sizes_it():
    memory = Memory(total_bytes=16 * GIB, free_bytes=10 * GIB, weights_bytes=3 * GIB, activation_bytes=GIB)
    # An accelerator: 0.5 of 16 GiB is 8 GiB; the weights take 3 and a pass's activations 1, so the KV gets 4.
    assert blocks(memory, gpu_memory_utilization=0.5) == 4 * 1024
    # A CPU: the KV cache space, whatever the utilization; the override wins over both.
    assert blocks(memory, accelerator=False, kv_cache_space_gib=2.5) == 2560
    assert blocks(memory, num_blocks_override=777) == 777


def test_kv_cache_sizes_that_cannot_be_met_are_refused():
    memory = Memory(total_bytes=16 * GIB, free_bytes=2 * GIB, weights_bytes=3 * GIB, activation_bytes=GIB)
    with pytest.raises(ValueError, match="weights take 3.00 GiB"):
        blocks(memory, gpu_memory_utilization=0.2)
    with pytest.raises(ValueError, match="only 2.00 GiB is free"):  # other processes hold the rest
        blocks(memory, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="more than the 2.00 GiB"):
        blocks(memory, accelerator=False, kv_cache_space_gib=4)


def test_memory_figures(tmp_path, runner):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2000 kB\nMemAvailable: 1000 kB\n")
    assert total_memory_bytes("cpu", meminfo_path=str(meminfo)) == 2000 * 1024
    assert free_memory_bytes("cpu", meminfo_path=str(meminfo)) == 1000 * 1024
    params = sum(p.numel() for p in runner.model.parameters())
    assert params * 4 <= weights_bytes(runner.model) < params * 4 + 64 * 1024  # fp32, plus small buffers


def test_seed_everything_makes_the_global_generators_repeat():
    seed_everything(7)
    first = (random.random(), torch.rand(3))
    seed_everything(7)
    second = (random.random(), torch.rand(3))
    assert first[0] == second[0] and torch.equal(first[1], second[1])
