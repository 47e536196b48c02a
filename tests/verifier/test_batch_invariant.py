"""Batch-invariant bf16 passes: a token verified in a draft tree, beside other
sequences, gets the bits a plain decode step gives it, so speculation cannot
change a greedy choice; and the mode is chosen as --batch-invariant says."""

import pytest
import torch
from torch import nn

from tests.verifier.architectures import SERVED, save_tiny
from tests.verifier.conftest import BLOCK
from verifier_service import batch_invariant
from verifier_service.attention import cpu_invariant
from verifier_service.batch_invariant import (
    PaddedLinear,
    differing_from_plain_decode,
    fewest_rows,
    holds_on,
    in_order_sum,
    key_order,
    make_invariant,
    make_linears_invariant,
    spread_values,
    uncovered_products,
)
from verifier_service.block_manager import BlockManager
from verifier_service.engine import Engine
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits
from verifier_service.self_check import check_against_reference
from verifier_service.sequence import Draft, GenerationParams

CPU = torch.device("cpu")
SMOLLM2_SIZES = (9, 3, 64)  # heads, kv heads, head dim
# An EAGLE-2 tree of 4 levels of 4: each level's nodes under one node of the level above, not the first.
WIDE_TREE = (-1, -1, -1, -1, 1, 1, 1, 1, 6, 6, 6, 6, 8, 8, 8, 8)
needs_invariant_bf16 = pytest.mark.skipif(not holds_on(CPU, torch.bfloat16, SMOLLM2_SIZES),
                                          reason="this CPU's bf16 attention is not batch-invariant")
# Whether a product with a weight can be padded to invariance depends on its shape and the CPU's kernels (the
# verifier checks each of its model's shapes and serves without invariance where one fails).
SMOLLM2_MLP_SHAPES = ((1536, 576), (576, 1536))
needs_invariant_bf16_mlp = pytest.mark.skipif(
    not all(fewest_rows(nn.Linear(columns, rows).bfloat16().weight.detach()) for rows, columns in SMOLLM2_MLP_SHAPES),
    reason="this CPU's bf16 products with weights of SmolLM2's MLP shapes cannot be padded to batch invariance")


def test_a_tree_node_attends_the_pending_tokens_then_its_path_in_sequence_order():
    order = key_order(1, (-1, -1, 1, 2), CPU)  # nodes b, c under the root; d under c; e under d
    assert order.is_tree
    assert order.columns.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 2, 1, 3, 4], [0, 2, 3, 1, 4],
                                      [0, 2, 3, 4, 1]]
    assert order.attends.sum(dim=1).tolist() == [1, 2, 2, 3, 4]


@needs_invariant_bf16
@pytest.mark.parametrize("num_pending,parents", [(1, (-1, -1, 0, 0, 1, 2, 4, 4)), (1, WIDE_TREE), (6, ()), (70, ())],
                         ids=["tree", "wide-tree", "chain", "prompt-chunk"])
def test_each_query_gets_the_bits_of_its_own_plain_decode(num_pending, parents):
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, start, capacity = 9, 3, 64, 90, 192
    n = num_pending + len(parents)
    query, keys, values = (spread_values(generator, CPU, torch.bfloat16, *shape)
                           for shape in ((heads, n, dim), (kv_heads, capacity, dim), (kv_heads, capacity, dim)))
    assert differing_from_plain_decode(query, keys, values, start, key_order(num_pending, parents, CPU)) == []


def greedy(engine: Engine, prompt, steps: int, tree_from=None, companion=None):
    """Greedy tokens and top-5 logprobs; with `tree_from` (a plain output) each step
    verifies a tree of 16 whose right path (the next 4 tokens) runs among wrong
    siblings, beside another sequence's plain step."""
    seq = engine.open("s", prompt, GenerationParams(max_new_tokens=steps, ignore_eos=True, logprobs=5))
    other = engine.open("o", companion, GenerationParams(max_new_tokens=10_000, ignore_eos=True)) if companion else None
    tokens, logprobs = [], []
    while len(tokens) < steps:
        draft = Draft()
        if tree_from is not None and len(tree_from) - len(tokens) >= 4:
            right = tree_from[len(tokens):len(tokens) + 4]
            # Levels of 4 siblings, the right token at a sibling that moves from step to step.
            at = len(tokens) % 4
            ids, parents, parent = [], [], -1
            for level, token in enumerate(right):
                ids += [token if j == at else (token + 7 * (j + 1)) % 64 for j in range(4)]
                parents += [parent] * 4
                parent = 4 * level + at
            draft = Draft(token_ids=tuple(ids), parents=tuple(parents))
        steps_now = [(seq, draft)] + ([(other, Draft())] if other else [])
        result = engine.run_together(steps_now)[0]
        tokens += result.token_ids
        logprobs += result.logprobs
    engine.close(seq)
    if other:
        engine.close(other)
    return tokens[:steps], logprobs[:steps]


# MoE blocks too (invariant_moe.py); MLA (DeepSeek-V3: values narrower than keys) through the torch operators;
# Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) in the fused layers (fused_layer.py).
@pytest.mark.parametrize("model_type, kernel", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", True),
                                                ("qwen3_moe", True), ("qwen3_moe", False), ("glm4_moe", True),
                                                ("deepseek_v3", False)])
def test_a_bf16_model_verifies_trees_with_the_bits_of_plain_decoding(tmp_path, kernel, model_type, monkeypatch):
    if not kernel:  # the torch operators' backend, which serves other devices, MLA and other head dimensions
        if not holds_on(CPU, torch.bfloat16, SMOLLM2_SIZES):
            pytest.skip("this CPU's bf16 attention is not batch-invariant")
        monkeypatch.setattr(cpu_invariant, "attends", lambda *args, **kwargs: False)
    # Heads of 16, a dimension the kernel is compiled for.
    fields = {**SERVED[model_type], "hidden_size": 64}
    if "head_dim" in fields:
        fields["head_dim"] = 16
    runner = ModelRunner(save_tiny(model_type, tmp_path, fields), "cpu", torch.bfloat16, batch_invariant="on")
    assert runner.backend.name == ("cpu-invariant" if kernel else "batch-invariant")
    engine = Engine(runner, BlockManager(4096 // BLOCK, BLOCK, False))
    prompt = [5, 9, 14, 3, 22, 40, 7, 19, 33]
    plain_tokens, plain_logprobs = greedy(engine, prompt, 24)
    tokens, logprobs = greedy(engine, prompt, 24, tree_from=plain_tokens, companion=[8, 1, 30, 12])
    assert tokens == plain_tokens
    assert logprobs == plain_logprobs  # the logits' bits, not only their argmax


def test_a_prompt_prefilled_in_chunks_decodes_as_one_prefilled_at_once(tmp_path):
    runner = ModelRunner(save_tiny("llama", tmp_path, {"hidden_size": 64}), "cpu", torch.bfloat16,
                         batch_invariant="on")
    assert runner.backend.name == "cpu-invariant"
    prompt = [5, 9, 14, 3, 22, 40, 7, 19, 33]
    whole = greedy(Engine(runner, BlockManager(4096 // BLOCK, BLOCK, False)), prompt, 6)
    # Chunks of 4 tokens: the first two keep no logits, so the output layer gets no rows.
    chunked = Engine(runner, BlockManager(4096 // BLOCK, BLOCK, False), BatchLimits(max_tokens=4))
    assert greedy(chunked, prompt, 6) == whole


def test_blocks_are_summed_with_the_same_bits_by_a_loop_as_by_cumsum():
    generator = torch.Generator().manual_seed(2)
    # Magnitudes 2^-40 to 2^40: no fp32 or fp64 sum of these is exact, so any other order or precision shows.
    products = (torch.randn(2, 17, 7, 64, 64, generator=generator)
                * 2.0 ** torch.randint(-40, 41, (2, 17, 7, 64, 64), generator=generator)).bfloat16()
    by_cumsum, by_loop = in_order_sum(products, 1), in_order_sum(products, 7 * 64)
    assert torch.equal(by_cumsum, by_loop)
    assert not torch.equal(by_loop, products.float().sum(dim=1))  # the data tells summation orders apart


def test_the_mode_follows_the_flag_the_dtype_and_the_start_up_check(monkeypatch):
    def mode(flag, dtype=torch.bfloat16, tensor_parallel=False):
        return make_invariant(flag, nn.Sequential(nn.Linear(64, 64)), CPU, dtype, tensor_parallel, SMOLLM2_SIZES)

    monkeypatch.setattr(batch_invariant, "holds_on", lambda *args: True)
    assert mode("auto")
    assert not mode("auto", torch.float32)  # fp32 stays as it was
    assert not mode("auto", tensor_parallel=True)  # not covered
    assert not mode("off")
    with pytest.raises(ValueError, match="tensor parallelism"):
        mode("on", tensor_parallel=True)
    monkeypatch.setattr(batch_invariant, "holds_on", lambda *args: False)
    assert not mode("auto")
    with pytest.raises(ValueError, match="start-up check"):
        mode("on")


def test_products_outside_linear_layers_keep_the_mode_off_or_are_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(batch_invariant, "holds_on", lambda *args: True)
    # Qwen3-Next: its MoE blocks are covered (invariant_moe.py), its gated DeltaNet's convolution is not.
    hybrid = ModelRunner(save_tiny("qwen3_next", tmp_path), "cpu", torch.bfloat16).model  # auto: off, unchanged
    assert uncovered_products(hybrid) == ["Conv1d"]
    assert not make_invariant("auto", hybrid, CPU, torch.bfloat16, False, SMOLLM2_SIZES)
    with pytest.raises(ValueError, match="in Conv1d, whose products are not linear"):
        make_invariant("on", hybrid, CPU, torch.bfloat16, False, SMOLLM2_SIZES)
    assert uncovered_products(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))) == []


@needs_invariant_bf16_mlp
def test_linear_layers_are_padded_to_the_rows_their_kernels_need_and_compute_the_same(monkeypatch):
    # oneDNN's padded products: what hosts without our kernels take (AMX's and AVX512-BF16's are tested with them).
    monkeypatch.setattr(batch_invariant, "amx_ready", lambda: False)
    monkeypatch.setattr(batch_invariant, "bf16_linear_ready", lambda: False)
    model = nn.Sequential(nn.Linear(576, 1536), nn.Linear(1536, 576)).bfloat16()
    x = torch.randn(5, 576).bfloat16()
    before = model(x)
    assert make_linears_invariant(model)
    assert all(isinstance(layer, PaddedLinear) for layer in model)
    assert torch.equal(model(x), before)  # five rows: no padding
    assert torch.equal(model(x[:1])[0], model(x)[0])  # one row, padded: the bits it gets among five


def test_an_order_without_a_tree_needs_no_reordering():
    order = key_order(3, (), CPU)
    assert not order.is_tree
    assert order.attends.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_a_layer_invariant_passes_cannot_attend_is_refused_at_start_with_the_reason(tmp_path):
    runner = ModelRunner(save_tiny("gemma2", tmp_path), "cpu", torch.bfloat16, batch_invariant="on")  # softcapping
    runner.allocate_cache(16, BLOCK)
    with pytest.raises(ValueError, match="no sliding window, softcapping or sinks: serve this model with") as error:
        check_against_reference(runner)  # a ValueError: the verifier's one-line refusal, not a traceback
    assert "\n" not in str(error.value)
