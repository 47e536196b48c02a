"""Device graphs of the engine's passes (verifier_service/graphs.py), on a CPU: a captured pass is the
model over metadata padded to the capture size and copied into static buffers. A "graph" here runs its
function again on replay into the outputs it captured, so what a real graph would get wrong through the
padding (rows that must see nothing, a scratch slot, rows past the pass) or the buffers (a pass's inputs not
copied in) shows as logits that differ from transformers'. With SPECLANE_TEST_DEVICE=cuda the same tests
capture real CUDA graphs (docs/benchmarks/device). The Ascend backend's ACL graphs are tested here on an EMULATION
of torch_npu and torch.npu (tests/verifier/npu_emulation.py): their layout, the FIA task groups and their updates,
not what a real NPU computes; with SPECLANE_TEST_DEVICE=npu the same tests capture real ACL graphs."""

import time
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from speclane.net import free_port
from verifier_service import model_runner
from verifier_service.attention.ascend import AscendAttention
from verifier_service.batch import Segment, StepPlan
from verifier_service.distributed import init_tensor_parallel
from verifier_service.graphs import DEFAULT_CAPTURE_SIZES, GraphSize, PassGraphs, capture_sizes
from verifier_service.layer_kernels import TorchKernels
from verifier_service.model_runner import ModelRunner
from verifier_service.npu_ops import NpuKernels
from verifier_service.scheduler import BatchLimits
from verifier_service.self_check import check_against_reference

from . import npu_emulation
from .architectures import save_tiny
from .conftest import make_engine
from .npu_emulation import GraphOps, acl_graphs, npu_fused_infer_attention_score
from .test_architectures import BLOCK, DEVICE, assert_passes_equal_transformers
from .test_batching import DRAFTERS, PROMPTS, run_together
from .test_engine import reference

ON_NPU = DEVICE.startswith("npu")
flex = pytest.mark.skipif(ON_NPU, reason="FlexAttention does not run on an NPU")


class Rerun:
    """A graph's stand-in: replay runs the captured function again, into the tensors the capture returned."""

    captures = 0

    def __init__(self, pool):
        pass

    @staticmethod
    def new_pool():
        return None

    def capture(self, forward, warm_up):
        Rerun.captures += 1
        self.forward = forward
        self.outputs = forward()
        return self.outputs

    def replay(self):
        for captured, new in zip(self.outputs, self.forward()):
            if captured is not None:
                captured.copy_(new)


def graphed_runner(model_type, path, sizes=(1, 2, 4, 8, 16, 24), kernels=None) -> ModelRunner:
    """kernels: the fused layers' operators, where not the device's own."""
    with mock.patch.object(model_runner, "device_kernels", lambda *a: kernels) if kernels else nullcontext():
        runner = ModelRunner(save_tiny(model_type, path), DEVICE, torch.float32, attention_backend="FLEX_ATTENTION",
                             cuda_graph_sizes=sizes)
    if DEVICE == "cpu":
        runner.graphs = PassGraphs(runner.padded_forward, runner.backend, sizes, runner.max_context_len,
                                   runner.device, runner.vocab_size, runner.dtype, graph=Rerun)
    runner.allocate_cache(64, BLOCK, num_state_slots=2)
    return runner


@flex
@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_passes_padded_to_a_capture_size_give_transformers_logits(model_type, tmp_path):
    """Prompts, decodes, a tree and a chain with a window, softcapping or sinks: passes of 19, 7 and 5 tokens
    run as the graphs of 24 and 8 (8 twice, with other inputs), and every row equals transformers' forward."""
    runner = graphed_runner(model_type, tmp_path)
    before = Rerun.captures
    runner.capture_graphs()  # as the verifier does at start
    assert sorted(size.tokens for size in runner.graphs.captured) == [1, 2, 4, 8, 16, 24]
    check_against_reference(runner)
    reference = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").to(DEVICE).eval()
    assert_passes_equal_transformers(runner, reference)
    if DEVICE == "cpu":
        assert Rerun.captures - before == 6  # each size captured once, at start; every pass after replays one
    assert runner.cache.num_blocks == 64 + 1  # the scratch block the padding rows write to
    for captured in runner.graphs.captured.values():  # a size's inputs: views of the one buffer a pass copies in
        buffer = captured.staged.device_bytes.untyped_storage().data_ptr()
        assert {value.untyped_storage().data_ptr() for value in captured.staged.inputs.values()} == {buffer}


@flex
@pytest.mark.e2e  # inductor runs the C++ compiler
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_cudas_configuration_replays_inductors_layer_operators_and_gives_transformers_logits(model_type, tmp_path):
    """What CUDA runs (FlexAttention, passes replayed from graphs, the fused layers' operators compiled by
    inductor), on this device: inductor's code for it, captured and replayed."""
    runner = graphed_runner(model_type, tmp_path, kernels=TorchKernels(compiled=True))
    assert runner.fused_layers == runner.model.config.num_hidden_layers
    runner.capture_graphs()
    check_against_reference(runner)
    reference = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").to(DEVICE).eval()
    assert_passes_equal_transformers(runner, reference)


@flex
def test_a_pass_runs_as_the_smallest_capture_size_that_holds_it_or_eagerly(tmp_path):
    runner = graphed_runner("llama", tmp_path, sizes=(1, 2, 4, 8))
    graphs = runner.graphs

    def plan(tokens, start=0):
        blocks = tuple(range(-(-(start + tokens) // BLOCK)))
        return StepPlan((), tuple(range(3, 3 + tokens)), (Segment(blocks, start, tokens),))

    assert [graphs.size_for(plan(n)) for n in (1, 2, 3, 5, 8, 9)] == [GraphSize(n, n) for n in (1, 2, 4, 8, 8)] + [None]
    longest = runner.max_context_len
    assert graphs.size_for(plan(1, longest - 1)) == GraphSize(1, 1)
    assert graphs.size_for(plan(1, longest + BLOCK)) is None  # past the tables' width: eagerly
    runner.allocate_cache(32, BLOCK)
    assert not graphs.captured and graphs.scratch_slot == 32 * BLOCK  # a new cache: captured again
    runner.feature_layers = (1,)
    assert not graphs.captured


def test_capture_sizes_default_to_vllms_thinned_up_to_the_pass_limit():
    assert capture_sizes("", 512) == DEFAULT_CAPTURE_SIZES
    assert capture_sizes("", 48) == (1, 2, 4, 8, 16, 24, 32, 48)
    assert capture_sizes("16, 4,4", 512) == (4, 16)


def test_graphs_are_for_flex_attention_on_cuda_and_the_fused_attention_on_npus(tmp_path):
    path = save_tiny("llama", tmp_path)
    runner = ModelRunner(path, DEVICE, torch.float32, cuda_graph_sizes=(1, 2))
    assert (runner.graphs is not None) == DEVICE.startswith(("cuda", "npu"))
    names = {"cuda": "flex-attention", "npu": "ascend-fia", "cpu": "cpu-paged"}
    assert runner.backend.name == names[DEVICE.split(":")[0]]
    assert ModelRunner(path, DEVICE, torch.float32, attention_backend="TORCH_SDPA",
                       cuda_graph_sizes=(1, 2)).graphs is None


def test_an_engine_on_captured_passes_decodes_as_transformers(tiny_model_dir, hf_model):
    """The engine's own plans through the graphs: four sequences joining and leaving, chunked prompts, right,
    wrong and partly right drafts (so KV moves and rollbacks), every pass of up to 8 tokens replayed."""
    runner = ModelRunner(tiny_model_dir, "cpu", torch.float32, attention_backend="FLEX_ATTENTION")
    runner.graphs = PassGraphs(runner.padded_forward, runner.backend, (1, 2, 4, 8), runner.max_context_len,
                               runner.device, runner.vocab_size, runner.dtype, graph=Rerun)
    engine = make_engine(runner, limits=BatchLimits(max_tokens=8))
    refs = [reference(hf_model, prompt, 12) for prompt in PROMPTS]
    seqs = run_together(engine, PROMPTS, refs, DRAFTERS, 12)
    for seq, ref, prompt in zip(seqs, refs, PROMPTS):
        assert seq.tokens[len(prompt):] == ref
    assert {4, 8} <= {size.tokens for size in runner.graphs.captured}  # chunks of 8 and the steps ran as graphs


def acl_graphed_runner(model_dir, ops: GraphOps, sizes=(1, 2, 4, 8, 16, 24, 32), tp=None) -> ModelRunner:
    """EMULATION: the Ascend backend over the emulated FIA, its passes in emulated ACL graphs (under TP, the
    cache is rank 0's to allocate); on an NPU, the real ones."""
    if ON_NPU:
        runner = ModelRunner(model_dir, DEVICE, torch.float32, tp=tp, cuda_graph_sizes=sizes)
        if tp is None:
            runner.allocate_cache(64, BLOCK)
        return runner
    with mock.patch.object(model_runner, "device_kernels", lambda *a: NpuKernels(npu_emulation)):
        runner = ModelRunner(model_dir, "cpu", torch.float32, tp=tp)
    heads = runner.model.config.get_text_config().num_attention_heads // runner.tp_size
    runner.backend = AscendAttention(heads, runner.geometry.kv_heads, npu_fused_infer_attention_score, ops)
    runner.graphs = PassGraphs(runner.padded_forward, runner.backend, sizes, runner.max_context_len, runner.device,
                               runner.vocab_size, runner.dtype, graph=acl_graphs(ops))
    if tp is None:
        runner.allocate_cache(64, BLOCK)
    return runner


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_ascend_passes_replayed_from_acl_graphs_give_transformers_logits(model_type, tmp_path):
    """EMULATION. Every size captured at start over a dummy pass; then prompts of 13 and 6 tokens run as the
    graph of 2 segments of 16, a chain of 4 with a decode as 2 segments of 4, a tree eagerly; each replay has
    every layer's FIA lengths updated first (a window in mistral's)."""
    ops = GraphOps()
    runner = acl_graphed_runner(save_tiny(model_type, tmp_path), ops)
    runner.capture_graphs()
    assert GraphSize(32, 2) in runner.graphs.captured and GraphSize(8, 2) in runner.graphs.captured
    updates = ops.updates
    check_against_reference(runner)
    reference = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").to(runner.device).eval()
    assert_passes_equal_transformers(runner, reference)
    if not ON_NPU:
        layers = runner.model.config.num_hidden_layers
        assert ops.updates > updates and (ops.updates - updates) % layers == 0  # every layer, every replay


def test_acl_graph_replays_without_the_length_updates_attend_the_captured_lengths(tmp_path, monkeypatch):
    """What the updates are for: a replay's FIA calls keep the lengths of the capture's dummy pass."""
    runner = acl_graphed_runner(save_tiny("llama", tmp_path), GraphOps())
    runner.capture_graphs()
    monkeypatch.setattr(AscendAttention, "update_graph", staticmethod(lambda tasks, host: None))
    reference = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").to(runner.device).eval()
    with pytest.raises(AssertionError):
        assert_passes_equal_transformers(runner, reference)


def test_acl_graphs_hold_decodes_and_chains_of_up_to_16_tokens_a_segment():
    backend = AscendAttention(4, 2, npu_fused_infer_attention_score, GraphOps())
    sizes = tuple(backend.graph_sizes((1, 2, 4, 8, 16, 24, 32)))
    assert {GraphSize(24, 24), GraphSize(24, 12), GraphSize(24, 6), GraphSize(24, 3)} <= set(sizes)
    assert GraphSize(32, 2) in sizes and GraphSize(24, 1) not in sizes  # 24 tokens are not a segment's
    assert sizes == tuple(sorted(sizes))

    def plan(*lengths, parents=()):
        segments = tuple(Segment((0, 1, 2, 3, 4), 10, n, parents) for n in lengths)
        return StepPlan((), tuple(range(1, 1 + sum(s.num_tokens for s in segments))), segments)

    assert backend.graph_size(plan(1, 1, 1), sizes, BLOCK, 64) == GraphSize(4, 4)
    assert backend.graph_size(plan(2, 1), sizes, BLOCK, 64) == GraphSize(4, 2)
    assert backend.graph_size(plan(1, parents=(-1, 0, 1)), sizes, BLOCK, 64) == GraphSize(4, 1)  # a chain
    assert backend.graph_size(plan(5, 3, 1), sizes, BLOCK, 64) == GraphSize(24, 3)
    assert backend.graph_size(plan(17), sizes, BLOCK, 64) is None  # a prompt chunk past 16 tokens: eagerly
    assert backend.graph_size(plan(1, parents=(-1, -1)), sizes, BLOCK, 64) is None  # a tree: eagerly
    assert backend.graph_size(plan(1), sizes, BLOCK, 2) is None  # past the tables' width
    laid_out = backend.graph_inputs(plan(2, 1), GraphSize(8, 2), BLOCK, 6, scratch_slot=64 * BLOCK)
    assert laid_out.rows == [1, 4]  # each segment's last token, at rows of 4
    assert laid_out.host == ([4, 8], [14, 14])  # cumulative query ends; keys to start + 4 (padding unseen)
    fields = laid_out.fields
    assert fields["input_ids"].tolist() == [1, 2, 0, 0, 3, 0, 0, 0]
    assert fields["positions"].tolist() == [10, 11, 11, 11, 10, 10, 10, 10]
    scratch = 64 * BLOCK
    assert fields["slot_mapping"].tolist() == [2 * BLOCK + 2, 2 * BLOCK + 3, scratch, scratch,
                                                2 * BLOCK + 2, scratch, scratch, scratch]
    assert fields["block_table"].tolist() == [[0, 1, 2, 3, 4, 64], [0, 1, 2, 3, 4, 64]]


def test_an_engine_on_acl_graphs_decodes_as_transformers(tiny_model_dir, hf_model):
    """EMULATION. The engine's own plans: chunked prompts, right and wrong drafts, sequences joining and
    leaving; every pass of decodes and chains replayed."""
    runner = acl_graphed_runner(tiny_model_dir, GraphOps(), sizes=(1, 2, 4, 8))
    engine = make_engine(runner, limits=BatchLimits(max_tokens=8))
    refs = [reference(hf_model, prompt, 12) for prompt in PROMPTS]
    seqs = run_together(engine, PROMPTS, refs, DRAFTERS, 12)
    for seq, ref, prompt in zip(seqs, refs, PROMPTS):
        assert seq.tokens[len(prompt):] == ref
    assert len(runner.graphs.captured) >= 3


def _acl_graphs_rank(rank: int, port: int, model_dir: str, results) -> None:
    """One rank of a TP=2 verifier on gloo whose Ascend backend and ACL graphs are emulated: rank 0 captures and
    runs the architecture matrix's passes; rank 1 runs what rank 0 broadcasts, as a follower does."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel("cpu", rank, 2, port)
    ops = GraphOps()
    runner = acl_graphed_runner(model_dir, ops, tp=tp)
    if rank:
        while (message := tp.receive()) is not None:
            runner.handle(message)
    else:
        try:
            runner.allocate_cache(64, BLOCK)
            runner.capture_graphs()
            check_against_reference(runner)  # as a verifier starts: its passes and reference forward on both ranks
            reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
            assert_passes_equal_transformers(runner, reference)
        finally:
            tp.broadcast(None)
    results.put((rank, sorted(runner.graphs.captured), ops.updates))
    dist.barrier()  # neither rank tears gloo down while the other still uses it (seen to abort at exit)
    dist.destroy_process_group()


@pytest.mark.e2e
def test_acl_graphs_under_tensor_parallelism_capture_and_replay_in_lockstep(tmp_path):
    """EMULATION, two ranks on gloo: every rank captures the same sizes at start (rank 0 broadcasts the capture
    passes), runs the start-up check's passes and reference forward, and replays the same graphs, so the
    collectives inside them pair up; rank 0's logits are transformers'."""
    results = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(_acl_graphs_rank, args=(free_port(), save_tiny("qwen3", tmp_path), results),
                               nprocs=2, join=False)
    deadline = time.monotonic() + 300  # ranks out of step wait on each other's collectives forever
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the ranks did not finish: their collectives are out of step")
    (_, sizes_0, updates_0), (_, sizes_1, updates_1) = sorted(results.get() for _ in range(2))
    assert sizes_0 == sizes_1 and GraphSize(8, 2) in sizes_0
    assert updates_0 == updates_1 > 0


class Uncapturable(Rerun):
    def capture(self, forward, warm_up):
        raise RuntimeError("ACL graph capture failed: Alloc sq cq fail\n(more lines)")


@flex
def test_a_device_that_cannot_capture_serves_every_pass_eagerly(tmp_path):
    runner = ModelRunner(save_tiny("llama", tmp_path), DEVICE, torch.float32, attention_backend="FLEX_ATTENTION")
    runner.graphs = PassGraphs(runner.padded_forward, runner.backend, (1, 2, 4), runner.max_context_len,
                               runner.device, runner.vocab_size, runner.dtype, graph=Uncapturable)
    runner.allocate_cache(64, BLOCK)
    runner.capture_graphs()
    assert runner.graphs is None
    check_against_reference(runner)
