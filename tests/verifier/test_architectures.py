"""Every architecture family served is right: the engine's prefill, decode and
tree-verify passes give transformers' own logits (eager attention, the whole
sequence at once), two sequences share a pass without changing them, and
greedy speculation (a chain and a tree) decodes what plain greedy decoding
does. The features that made earlier engines wrong are shown to matter here
(dropping them changes the logits). What is not served is refused by name."""

import asyncio
import dataclasses
import functools
import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.net import free_port
from verifier_service import model_runner
from verifier_service.attention import ascend, chosen_backend, select_backend
from verifier_service.attention import backend as attention_backend
from verifier_service.attention.ascend import AscendAttention
from verifier_service.attention.ascend import unsupported as ascend_unsupported
from verifier_service.batch import Segment, StateCommit, StepPlan
from verifier_service.block_manager import BlockManager, BlockTable, MoveSlots, slot
from verifier_service.engine import Engine
from verifier_service.linear_attention import LinearStates
from verifier_service.model_runner import ModelRunner, UnsupportedModel, unsupported
from verifier_service.npu_ops import NpuKernels
from verifier_service.sampling import SamplingParams
from verifier_service.self_check import check_against_reference
from verifier_service.sequence import Draft, GenerationParams

from . import npu_emulation
from .architectures import REFUSED, SERVED, save_tiny, tiny_config
from .npu_emulation import npu_fused_infer_attention_score

BLOCK = 4  # several blocks per sequence, so block tables are exercised
PROMPT = [(7 * i) % 90 + 3 for i in range(13)]
TREE = (9, 11, 13, 17, 21)
PARENTS = (-1, -1, 0, 2, 2)
TOLERANCE = 1e-4
# The same matrix on another device's backend: SPECLANE_TEST_DEVICE=cuda on a GPU host, npu on an Atlas host
# (docs/benchmarks/device).
DEVICE = os.environ.get("SPECLANE_TEST_DEVICE", "cpu")
if DEVICE.startswith("npu"):
    pytest.importorskip("torch_npu")  # makes "npu" a torch device


@pytest.fixture(scope="module", params=sorted(SERVED))
def model(request, tmp_path_factory):
    """(runner, transformers' model) of one architecture."""
    refused = unsupported(tiny_config(request.param, SERVED[request.param]), device_type=DEVICE.split(":")[0])
    if refused:  # on an NPU, what its attention operator does not offer
        pytest.skip(refused)
    path = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    runner = ModelRunner(path, DEVICE, torch.float32)
    runner.allocate_cache(64, BLOCK, num_state_slots=2)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    reference = reference.to(DEVICE).eval()
    return runner, reference


def last_logits(reference, tokens) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens], device=reference.device)).logits[0, -1]


def table_for(blocks: BlockManager, num_tokens: int) -> BlockTable:
    table = BlockTable()
    assert blocks.allocate(table, [], num_tokens) == 0
    return table


@pytest.mark.parametrize("calls", ["one call", "a call per length"])
def test_prefill_decode_and_tree_verify_passes_equal_transformers(model, calls, monkeypatch):
    runner, reference = model
    padded = getattr(runner.backend, "padded", runner.backend)  # the CPU's kernel leaves prompts and trees to SDPA
    if padded.name == "torch-sdpa":  # segments padded into one call, or each length bucket in its own
        monkeypatch.setattr(padded, "call_pairs", float("inf") if calls == "one call" else 0)
    assert_passes_equal_transformers(runner, reference)


# The architectures whose attention the Ascend backend serves (the rest it refuses at start).
ASCEND_SERVED = sorted(t for t in SERVED if not ascend_unsupported(tiny_config(t, SERVED[t])))


@pytest.mark.parametrize("model_type", ASCEND_SERVED)
def test_the_ascend_backend_on_an_emulation_of_its_operator_gives_transformers_logits(model_type, tmp_path):
    """EMULATION: torch_npu's fused attention and layer operators replaced by tests/verifier/npu_emulation.py."""
    kernels = NpuKernels(npu_emulation)
    with mock.patch.object(model_runner, "device_kernels", lambda *a: kernels):
        runner = ModelRunner(save_tiny(model_type, tmp_path), "cpu", torch.float32)
    heads = runner.model.config.get_text_config().num_attention_heads
    runner.backend = AscendAttention(heads, runner.geometry.kv_heads, npu_fused_infer_attention_score)
    fused_norms = [m for m in runner.model.modules() if getattr(m, "fused_rms_norm", None) == kernels.rms_norm]
    assert fused_norms or model_type in ("gemma3_text", "qwen3_next", "qwen3_5_text")  # norms: (1 + weight) form
    assert bool(runner.fused_layers) == (model_type in ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe"))
    runner.allocate_cache(64, BLOCK, num_state_slots=2)
    assert runner.cache.kv is None  # keys and values apart, as the operator reads them
    check_against_reference(runner)  # what a verifier on an NPU runs at start: passes here
    reference = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    assert_passes_equal_transformers(runner, reference)


@pytest.mark.parametrize("model_type", sorted(t for t in SERVED if t != "deepseek_v3"))
def test_the_flex_attention_backend_gives_transformers_logits(model_type, tmp_path):
    """FlexAttention in eager mode (on CUDA the same call is compiled): its mask and score functions decide
    what each query sees over the whole cache, so a wrong one shows here as wrong logits."""
    runner = ModelRunner(save_tiny(model_type, tmp_path), "cpu", torch.float32, attention_backend="FLEX_ATTENTION")
    assert runner.backend.name == "flex-attention"
    runner.allocate_cache(64, BLOCK, num_state_slots=2)
    check_against_reference(runner)
    reference = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    assert_passes_equal_transformers(runner, reference)


def test_flex_attention_is_refused_where_it_cannot_attend(tmp_path):
    with pytest.raises(UnsupportedModel, match="MLA's latent cache"):
        ModelRunner(save_tiny("deepseek_v3", tmp_path), "cpu", torch.float32, attention_backend="FLEX_ATTENTION")
    with pytest.raises(ValueError, match="on an NPU"):
        select_backend(SimpleNamespace(type="npu"), torch.bfloat16, False, 8, 2, 64, choice="FLEX_ATTENTION")


def test_flex_attention_is_compiled_on_cuda_and_chosen_there_by_name():
    cuda = SimpleNamespace(type="cuda")
    backend = select_backend(cuda, torch.bfloat16, False, 8, 2, 64, choice="FLEX_ATTENTION")
    assert (backend.name, backend.split_kv, backend.compiled) == ("flex-attention", True, True)
    assert not select_backend(torch.device("cpu"), torch.float32, False, 8, 2, 64, choice="FLEX_ATTENTION").compiled
    # auto on CUDA: FlexAttention (its passes are captured as CUDA graphs), but not for MLA's latent cache or
    # where invariant passes are asked for
    assert chosen_backend("auto", "cuda", latent=False, batch_invariant="auto", head_dim=64) == "FLEX_ATTENTION"
    assert chosen_backend("auto", "cuda", latent=True, batch_invariant="auto", head_dim=64) == "auto"
    assert chosen_backend("auto", "cuda", latent=False, batch_invariant="on", head_dim=64) == "auto"
    assert chosen_backend("auto", "cuda", latent=False, batch_invariant="auto", head_dim=8) == "auto"
    assert chosen_backend("auto", "cpu", latent=False, batch_invariant="auto", head_dim=64) == "auto"
    assert chosen_backend("TORCH_SDPA", "cuda", latent=False, batch_invariant="auto", head_dim=64) == "TORCH_SDPA"
    with pytest.raises(ValueError, match="at least 16"):
        select_backend(cuda, torch.bfloat16, False, 8, 2, 8, choice="FLEX_ATTENTION")


@pytest.mark.parametrize("model_type,words", [("gemma2", "softcapping"), ("gpt_oss", "sinks"),
                                              ("deepseek_v3", "MLA")])
def test_what_the_ascend_operator_cannot_attend_is_refused_on_an_npu_only(model_type, words):
    config = tiny_config(model_type, SERVED[model_type])
    assert unsupported(config) is None
    reason = unsupported(config, device_type="npu")
    assert words in reason and model_type in reason and "\n" not in reason


def test_an_npu_attends_through_the_ascend_operator_unless_passes_must_be_batch_invariant(monkeypatch):
    monkeypatch.setattr(ascend, "_fused_infer_attention_score", lambda: npu_fused_infer_attention_score)
    npu = SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
    backend = select_backend(npu, torch.bfloat16, False, 8, 2, 64)
    assert (backend.name, backend.split_kv, backend.kv_heads) == ("ascend-fia", True, 2)
    assert select_backend(npu, torch.bfloat16, True, 8, 2, 64).name == "batch-invariant"


def assert_passes_equal_transformers(runner, reference):
    blocks = BlockManager(64, BLOCK, enable_prefix_caching=False)
    a, b = table_for(blocks, 32), table_for(blocks, 32)
    other = [(5 * i) % 90 + 3 for i in range(6)]
    # Pass 1: a's prompt and b's shorter one; pass 2: a decodes, b verifies a tree; pass 3: a verifies a chain.
    a_seg, b_seg = (functools.partial(Segment, tuple(table.blocks), state_slot=slot)
                    for slot, table in enumerate((a, b)))
    logits, _ = runner.execute(StepPlan((), (*PROMPT, *other), (a_seg(0, len(PROMPT)), b_seg(0, len(other)))))
    assert torch.allclose(logits[0], last_logits(reference, PROMPT), atol=TOLERANCE)
    assert torch.allclose(logits[1], last_logits(reference, other), atol=TOLERANCE)
    logits, _ = runner.execute(StepPlan((), (4, 5, *TREE), (a_seg(len(PROMPT), 1), b_seg(len(other), 1, PARENTS))))
    assert torch.allclose(logits[0], last_logits(reference, PROMPT + [4]), atol=TOLERANCE)
    paths = ([], [0], [1], [0, 2], [0, 2, 3], [0, 2, 4])
    for row, path in enumerate(paths, start=1):
        expected = last_logits(reference, other + [5] + [TREE[i] for i in path])
        assert torch.allclose(logits[row], expected, atol=TOLERANCE), path
    # Pass 3: a verifies a chain; b goes on after accepting the tree path [0, 2, 3] (its KV moved up to follow,
    # its linear-attention state kept from that path's last node).
    chain, base = (30, 31, 32), len(other) + 1
    accepted = MoveSlots(tuple(slot(b.blocks, base + node, BLOCK) for node in (0, 2, 3)),
                         tuple(slot(b.blocks, base + i, BLOCK) for i in range(3)))
    logits, _ = runner.execute(StepPlan((accepted,), (6, *chain, 40),
                                        (a_seg(len(PROMPT) + 1, 1, (-1, 0, 1)), b_seg(base + 3, 1)),
                                        (StateCommit(0, 0), StateCommit(1, 4))))
    for row in range(len(chain) + 1):
        expected = last_logits(reference, PROMPT + [4, 6, *chain[:row]])
        assert torch.allclose(logits[row], expected, atol=TOLERANCE)
    after_tree = other + [5] + [TREE[node] for node in (0, 2, 3)] + [40]
    assert torch.allclose(logits[len(chain) + 1], last_logits(reference, after_tree), atol=TOLERANCE)


# Each feature, with where transformers hands it to the attention function, and a model that has it.
FEATURES = {"sliding_window": "mistral", "softcap": "gemma2", "sinks": "gpt_oss"}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_dropping_a_feature_changes_the_logits(feature, tmp_path, monkeypatch):
    """The matrix would catch an engine that ignores the feature, as an earlier one did."""
    runner = ModelRunner(save_tiny(FEATURES[feature], tmp_path), DEVICE, torch.float32)
    runner.allocate_cache(16, BLOCK)
    table = table_for(BlockManager(16, BLOCK, False), len(PROMPT))
    plan = StepPlan((), tuple(PROMPT), (Segment(tuple(table.blocks), 0, len(PROMPT)),))
    served = runner.execute(plan)[0]
    original = attention_backend.LayerCall

    def without(*args, **kwargs):
        return dataclasses.replace(original(*args, **kwargs), **{feature: None})

    monkeypatch.setattr("verifier_service.attention.LayerCall", without)
    assert (runner.execute(plan)[0] - served).abs().max() > 1e-3


def test_mla_caches_its_latent_not_the_expanded_keys_and_values(tmp_path):
    """DeepSeek-V3's KV per token is its compressed latent and rotary key (576 numbers a layer at full size),
    not every head's expansion (40,960): here 16 + 4 per layer against 4 heads x (12 + 6)."""
    fields = SERVED["deepseek_v3"]
    runner = ModelRunner(save_tiny("deepseek_v3", tmp_path), "cpu", torch.float32)
    latent = fields["kv_lora_rank"] + fields["qk_rope_head_dim"]
    assert runner.kv_bytes_per_token == 2 * latent * 4  # two layers of fp32


def greedy_reference(reference, prompt, n) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt], device=reference.device), max_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_speculation_with_chains_and_trees_equals_plain_decoding(model):
    runner, reference = model
    expected = greedy_reference(reference, PROMPT, 16)
    # Cached prefixes would skip a linear-attention state (the engine refuses them for such models).
    engine = Engine(runner, BlockManager(64, BLOCK, enable_prefix_caching=not runner.linear_layers))
    params = GenerationParams(SamplingParams(temperature=0.0), max_new_tokens=16, ignore_eos=True)
    for tree in (False, True):
        seq = engine.open("s", PROMPT, params)
        engine.prefill(seq)
        while not seq.finished:
            future = expected[seq.num_generated:]
            right = tuple(future[:3])
            # A tree whose first branch is wrong and whose second holds the right continuation.
            draft = (Draft((right[0] ^ 1, *right), (-1, -1, 1, 2)[:len(right) + 1]) if tree and len(right) == 3
                     else Draft(right))
            engine.verify(seq, draft)
        assert seq.tokens[len(PROMPT):] == expected
        engine.close(seq)


def test_keeping_a_rejected_drafts_linear_attention_state_changes_the_output(tmp_path, monkeypatch):
    """The rollback matters: a state that runs on through rejected draft tokens decodes something else."""
    runner = ModelRunner(save_tiny("qwen3_next", tmp_path), DEVICE, torch.float32)
    engine = Engine(runner, BlockManager(64, BLOCK, enable_prefix_caching=False))
    params = GenerationParams(SamplingParams(temperature=0.0), max_new_tokens=32, ignore_eos=True)

    def decode_with_wrong_drafts() -> list[int]:
        seq = engine.open("s", PROMPT, params)
        engine.prefill(seq)
        while seq.num_generated < 12:  # far from the budget, which would shorten the drafts
            engine.verify(seq, Draft((1, 2, 3)))  # rejected at its first token, almost always
        engine.close(seq)
        return seq.tokens[len(PROMPT):]

    served = decode_with_wrong_drafts()
    kept = {}

    def keep_last_node(states, commits):  # as if every draft node had been accepted
        kept.update(commits=commits)
        original_commit(states, tuple(StateCommit(c.slot, 3) for c in commits))

    original_commit = LinearStates.commit
    monkeypatch.setattr(LinearStates, "commit", keep_last_node)
    assert decode_with_wrong_drafts() != served and kept


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_unsupported_architectures_are_refused_by_name(model_type, tmp_path):
    fields, words = REFUSED[model_type]
    path = save_tiny(model_type, tmp_path, fields)
    with pytest.raises(UnsupportedModel) as refused:
        ModelRunner(path, "cpu", torch.float32)
    message = str(refused.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "deepseek_v3", "qwen3_next"])
def test_the_start_up_check_passes_where_the_engine_is_right(model_type, tmp_path):
    runner = ModelRunner(save_tiny(model_type, tmp_path), DEVICE, torch.float32)
    runner.allocate_cache(16, BLOCK)
    check_against_reference(runner)


def test_the_start_up_check_refuses_an_engine_that_is_wrong(tmp_path, monkeypatch):
    """As the last guard: an attention that drops the window (what an earlier engine did) is caught at start."""
    runner = ModelRunner(save_tiny("mistral", tmp_path), DEVICE, torch.float32)
    runner.allocate_cache(16, BLOCK)
    original = attention_backend.LayerCall
    monkeypatch.setattr("verifier_service.attention.LayerCall",
                        lambda *args, **kwargs: dataclasses.replace(original(*args, **kwargs), sliding_window=None))
    with pytest.raises(ValueError, match=r"^mistral: the engine's logits differ from transformers' reference") as err:
        check_against_reference(runner)
    assert "\n" not in str(err.value)
    check_against_reference(runner, refuse=False)  # --reference-check warn: served, with a warning


@pytest.mark.e2e
def test_the_verifier_process_refuses_an_unsupported_architecture_in_one_line(tmp_path):
    fields, words = REFUSED["jamba"]
    path = save_tiny("jamba", tmp_path, fields)
    done = subprocess.run([sys.executable, "-m", "verifier_service", "--model", path, "--device", "cpu",
                           "--threads", "1", "--address", "127.0.0.1:0", "--log-level", "error"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("verifier: refused to start: jamba: ") and "Traceback" not in done.stderr
    assert all(word in last for word in words), last


async def _served_greedy(port: int, prompt: list[int], expected: list[int]) -> list[int]:
    """Greedy tokens over the verifier's gRPC session, each step verifying a tree whose first branch is wrong
    and whose second holds the right continuation, every third step a wrong chain."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        for _ in range(600):
            try:
                await stub.GetModelInfo(verifier_pb2.GetModelInfoRequest())
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        call = stub.Session()
        sampling = verifier_pb2.SamplingParams(max_new_tokens=len(expected), ignore_eos=True)
        await call.write(verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(
            sequence_id="arch", prompt_token_ids=prompt, sampling=sampling)))
        tokens = list((await call.read()).token_ids)
        for step in range(len(expected)):
            right = expected[len(tokens): len(tokens) + 3]
            tree = common_pb2.Draft(token_ids=[(right[0] + 1) % 90, *right], parents=[-1, -1, 1, 2][:len(right) + 1])
            draft = tree if step % 3 and right else common_pb2.Draft(token_ids=[3, 4, 5])
            await call.write(verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(draft=draft)))
            reply = await call.read()
            tokens += reply.token_ids
            if reply.finish_reason:
                break
        return tokens


@pytest.mark.e2e
def test_a_served_linear_attention_model_decodes_what_transformers_does(tmp_path):
    """Qwen3-Next through the verifier process: prefill, trees and chains over gRPC, drafts rejected and
    accepted, give transformers' greedy tokens."""
    path = save_tiny("qwen3_next", tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = greedy_reference(reference, PROMPT, 20)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "verifier_service", "--model", path, "--device", "cpu",
                                "--threads", "1", "--address", f"127.0.0.1:{port}", "--log-level", "error"],
                               stderr=subprocess.PIPE, text=True)
    try:
        assert asyncio.run(_served_greedy(port, PROMPT, expected)) == expected
    finally:
        process.terminate()
        process.wait(30)
