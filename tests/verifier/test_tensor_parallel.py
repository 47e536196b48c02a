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
from protos.conventions import chain_parents
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.net import free_port
from verifier_service.distributed import backend_for, check_shardable, rank_device
from verifier_service.sequence import Draft, GenerationParams
from verifier_service.tree import depths, is_chain

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



async def _model_info_when_loaded(stub) -> verifier_pb2.ModelInfo:
    for _ in range(600):
        try:
            return await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest())
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.1)
    raise TimeoutError("the verifier did not load its model")


async def _generate(port: int) -> tuple[int, list[int]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        info = await _model_info_when_loaded(stub)
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


@pytest.mark.e2e
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
                               "--tensor-parallel-size", "2", "--num-gpu-blocks-override", "64",
                               "--log-level", "warning"])
    try:
        tp_size, tokens = asyncio.run(asyncio.wait_for(_generate(port), 120))
    finally:
        server.terminate()
        assert server.wait(60) == 0
    assert tp_size == 2
    assert tokens == expected


async def _generate_with_head(port: int, prompt: list[int], k: int) -> tuple[int, list[int], int, int]:
    """Greedy generation verifying the verifier head's own drafts: (TP size, tokens, accepted, tree drafts)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        info = await _model_info_when_loaded(stub)
        call = stub.Session()
        sampling = verifier_pb2.SamplingParams(max_new_tokens=24, ignore_eos=True)
        await call.write(verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(
            sequence_id="tp-head", prompt_token_ids=prompt, sampling=sampling, num_head_draft_tokens=k)))
        reply = await call.read()
        tokens, accepted, trees = list(reply.token_ids), 0, 0
        while not reply.finish_reason:
            draft = reply.head_draft
            depth = max(depths(draft.parents or chain_parents(len(draft.token_ids))), default=0)
            deepest = min(k, 24 - len(tokens) - 1)  # a tree keeps its likeliest nodes, maybe not the deepest
            assert depth == deepest if is_chain(draft.parents) else 0 < depth <= deepest
            trees += not is_chain(draft.parents)
            await call.write(verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(use_head_draft=True)))
            reply = await call.read()
            tokens += reply.token_ids
            accepted += reply.num_accepted_draft_tokens
        assert info.draft_head == "eagle3"
        return info.tensor_parallel_size, tokens, accepted, trees


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=128,
                       initializer_range=0.5, eos_token_id=2)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=128,
                       initializer_range=0.5, eos_token_id=2)


@pytest.mark.e2e
@pytest.mark.parametrize("target, ranks, tree", [
    (_llama, 3, {}), (_llama, 3, {"eagle_topk": 3, "num_draft_tokens": 6}),
    (_qwen3, 4, {}),  # the production shape: Qwen3 at TP = 4
], ids=["chains", "trees", "qwen3-tp4"])
def test_ranks_with_an_eagle3_head_on_rank_0_give_the_plain_greedy_tokens(tmp_path, target, ranks, tree):
    """The head runs on rank 0 from the replicated hidden states; the whole
    embedding and lm_head come from the checkpoint, not the rank's shards."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from tests.heads_support import write_random_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(target()).eval()
    model.save_pretrained(tmp_path / "target")
    head_dir = write_random_head("eagle3", tmp_path / "target", tmp_path / "head")
    prompt = [5, 9, 11, 20, 7, 30]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=None)[0, len(prompt):].tolist()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "verifier_service", "--model", str(tmp_path / "target"),
                               "--device", "cpu", "--address", f"127.0.0.1:{port}", "--threads", "1",
                               "--tensor-parallel-size", str(ranks), "--num-gpu-blocks-override", "64",
                               "--log-level", "warning",
                               "--speculative-config", json.dumps({"method": "eagle3", "model": str(head_dir), **tree}),
                               # Every head draft as deep as k, whatever this host's measured cost of a draft token.
                               "--speculation-debug", json.dumps({"draft_token_cost": 0})])
    try:
        tp_size, tokens, _, trees = asyncio.run(asyncio.wait_for(_generate_with_head(port, prompt, 3), 120))
    finally:
        server.terminate()
        assert server.wait(60) == 0
    assert tp_size == ranks
    assert tokens == expected
    assert (trees > 0) == bool(tree)
