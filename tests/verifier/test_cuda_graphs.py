"""CUDA graphs of the engine's passes (verifier_service/cuda_graphs.py), on a CPU: a captured pass is the
model over metadata padded to the capture size and copied into static buffers. A "graph" here runs its
function again on replay into the outputs it captured, so what a real graph would get wrong through the
padding (rows that must see nothing, a scratch slot, rows past the pass) or the buffers (a pass's inputs not
copied in) shows as logits that differ from transformers'. With SPECLANE_TEST_DEVICE=cuda the same tests
capture real CUDA graphs (docs/benchmarks/device)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from verifier_service.batch import Segment, StepPlan
from verifier_service.cuda_graphs import DEFAULT_CAPTURE_SIZES, PassGraphs, capture_sizes
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits
from verifier_service.self_check import check_against_reference

from .architectures import save_tiny
from .conftest import make_engine
from .test_architectures import BLOCK, DEVICE, assert_passes_equal_transformers
from .test_batching import DRAFTERS, PROMPTS, run_together
from .test_engine import reference


class Rerun:
    """A graph's stand-in: replay runs the captured function again, into the tensors the capture returned."""

    captures = 0

    def __init__(self, pool):
        pass

    @staticmethod
    def new_pool():
        return None

    def capture(self, forward):
        Rerun.captures += 1
        self.forward = forward
        self.outputs = forward()
        return self.outputs

    def replay(self):
        for captured, new in zip(self.outputs, self.forward()):
            if captured is not None:
                captured.copy_(new)


def graphed_runner(model_type, path, sizes=(1, 2, 4, 8, 16, 24)) -> ModelRunner:
    runner = ModelRunner(save_tiny(model_type, path), DEVICE, torch.float32, attention_backend="FLEX_ATTENTION",
                         cuda_graph_sizes=sizes)
    if DEVICE == "cpu":
        runner.graphs = PassGraphs(runner.padded_forward, sizes, runner.max_context_len, runner.device,
                                   runner.vocab_size, runner.dtype, graph=Rerun)
    runner.allocate_cache(64, BLOCK, num_state_slots=2)
    return runner


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_passes_padded_to_a_capture_size_give_transformers_logits(model_type, tmp_path):
    """Prompts, decodes, a tree and a chain with a window, softcapping or sinks: passes of 19, 7 and 5 tokens
    run as the graphs of 24 and 8 (8 twice, with other inputs), and every row equals transformers' forward."""
    runner = graphed_runner(model_type, tmp_path)
    before = Rerun.captures
    runner.capture_graphs()  # as the verifier does at start
    assert sorted(runner.graphs.captured) == [1, 2, 4, 8, 16, 24]
    check_against_reference(runner)
    reference = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").to(DEVICE).eval()
    assert_passes_equal_transformers(runner, reference)
    if DEVICE == "cpu":
        assert Rerun.captures - before == 6  # each size captured once, at start; every pass after replays one
    assert runner.cache.num_blocks == 64 + 1  # the scratch block the padding rows write to


def test_a_pass_runs_as_the_smallest_capture_size_that_holds_it_or_eagerly(tmp_path):
    runner = graphed_runner("llama", tmp_path, sizes=(1, 2, 4, 8))
    graphs = runner.graphs

    def plan(tokens, start=0):
        blocks = tuple(range(-(-(start + tokens) // BLOCK)))
        return StepPlan((), tuple(range(3, 3 + tokens)), (Segment(blocks, start, tokens),))

    assert [graphs.size_for(plan(n)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    longest = runner.max_context_len
    assert graphs.size_for(plan(1, longest - 1)) == 1
    assert graphs.size_for(plan(1, longest + BLOCK)) is None  # past the tables' width: eagerly
    runner.allocate_cache(32, BLOCK)
    assert not graphs.captured and graphs.scratch_slot == 32 * BLOCK  # a new cache: captured again
    runner.feature_layers = (1,)
    assert not graphs.captured


def test_capture_sizes_default_to_vllms_thinned_up_to_the_pass_limit():
    assert capture_sizes("", 512) == DEFAULT_CAPTURE_SIZES
    assert capture_sizes("", 48) == (1, 2, 4, 8, 16, 24, 32, 48)
    assert capture_sizes("16, 4,4", 512) == (4, 16)


def test_graphs_are_for_flex_attention_on_cuda(tmp_path):
    path = save_tiny("llama", tmp_path)
    runner = ModelRunner(path, DEVICE, torch.float32, cuda_graph_sizes=(1, 2))
    assert (runner.graphs is not None) == DEVICE.startswith("cuda")
    assert runner.backend.name == ("flex-attention" if DEVICE.startswith("cuda") else "cpu-paged")
    assert ModelRunner(path, DEVICE, torch.float32, attention_backend="TORCH_SDPA",
                       cuda_graph_sizes=(1, 2)).graphs is None


def test_an_engine_on_captured_passes_decodes_as_transformers(tiny_model_dir, hf_model):
    """The engine's own plans through the graphs: four sequences joining and leaving, chunked prompts, right,
    wrong and partly right drafts (so KV moves and rollbacks), every pass of up to 8 tokens replayed."""
    runner = ModelRunner(tiny_model_dir, "cpu", torch.float32, attention_backend="FLEX_ATTENTION")
    runner.graphs = PassGraphs(runner.padded_forward, (1, 2, 4, 8), runner.max_context_len, runner.device,
                               runner.vocab_size, runner.dtype, graph=Rerun)
    engine = make_engine(runner, limits=BatchLimits(max_tokens=8))
    refs = [reference(hf_model, prompt, 12) for prompt in PROMPTS]
    seqs = run_together(engine, PROMPTS, refs, DRAFTERS, 12)
    for seq, ref, prompt in zip(seqs, refs, PROMPTS):
        assert seq.tokens[len(prompt):] == ref
    assert {4, 8} <= set(runner.graphs.captured)  # chunks of 8 and the sequences' steps ran as graphs
