"""Tensor parallelism on the CPU (gloo): a real two-rank verifier process
gives the same greedy tokens as one rank; backend, device and shardability
rules; Ascend memory and KV budget logic without torch_npu."""

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest

from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.net import free_port
from verifier_service.device import free_memory_bytes, kv_budget_tokens
from verifier_service.distributed import backend_for, check_shardable, rank_device
from verifier_service.sequence import Draft, GenerationParams

from .test_engine import GREEDY, PROMPT

TREE = (common_pb2.Draft(token_ids=[45, 18, 30, 38], parents=[-1, 0, 0, 1]),
        common_pb2.Draft(token_ids=[1, 2], parents=[-1, -1]), common_pb2.Draft())


def test_backends_and_rank_devices():
    assert [backend_for(d) for d in ("cpu", "cuda:1", "npu", "npu:3")] == ["gloo", "nccl", "hccl", "hccl"]
    assert [rank_device(d, 1) for d in ("cpu", "cuda", "npu:0")] == ["cpu", "cuda:1", "npu:1"]


def test_shardability():
    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        check_shardable(smollm2, 2)
    check_shardable(smollm2, 3)
    qwen3_32b = SimpleNamespace(num_attention_heads=64, num_key_value_heads=8, intermediate_size=25600)
    check_shardable(qwen3_32b, 4)


def test_kv_budget_from_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable: 1000 kB\n")
    free = free_memory_bytes("cpu", meminfo_path=str(meminfo))
    assert free == 1024000
    assert kv_budget_tokens(0, 0.5, free, 1000) == 512
    assert kv_budget_tokens(4096, 0.5, free, 1000) == 4096



async def _generate(port: int) -> tuple[int, list[int]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        for _ in range(600):
            try:
                info = await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest())
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        call = stub.Session()
        sampling = verifier_pb2.SamplingParams(max_new_tokens=24, ignore_eos=True)
        await call.write(verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(
            sequence_id="tp", prompt_token_ids=PROMPT, sampling=sampling)))
        tokens = list((await call.read()).token_ids)
        step = 0
        while True:
            await call.write(verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(draft=TREE[step % 3])))
            reply = await call.read()
            tokens += reply.token_ids
            step += 1
            if reply.finish_reason:
                return info.tensor_parallel_size, tokens


def test_two_ranks_give_the_same_greedy_tokens_as_one(tiny_model_dir, engine):
    seq = engine.open("ref", PROMPT, GenerationParams(GREEDY, max_new_tokens=24, ignore_eos=True))
    expected = engine.prefill(seq).token_ids
    step = 0
    while not seq.finished:
        draft = TREE[step % 3]
        expected += engine.verify(seq, Draft(tuple(draft.token_ids), tuple(draft.parents))).token_ids
        step += 1
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "verifier_service", "--model", tiny_model_dir,
                               "--device", "cpu", "--address", f"127.0.0.1:{port}", "--threads", "1",
                               "--tensor-parallel-size", "2", "--max-kv-tokens", "4096", "--log-level", "warning"])
    try:
        tp_size, tokens = asyncio.run(asyncio.wait_for(_generate(port), 120))
    finally:
        server.terminate()
        assert server.wait(60) == 0
    assert tp_size == 2
    assert tokens == expected
