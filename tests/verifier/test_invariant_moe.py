"""Batch-invariant MoE blocks (invariant_moe.py): an expert's rows padded to the rows its weights need, a router's
likewise, so a token routed to an expert alone gets the bits it gets among other tokens; what they compute is
transformers' own experts forward; and a block the padding cannot fix is refused by name."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.verifier.architectures import save_tiny
from verifier_service import batch_invariant, invariant_moe
from verifier_service.batch_invariant import make_invariant
from verifier_service.bf16_linear import bf16_linear_ready
from verifier_service.invariant_moe import INVARIANT, PackedExperts, PaddedExperts, make_moe_invariant, moe_blocks
from verifier_service.row_padding import fewest_rows, spread_values

CPU = torch.device("cpu")


def differs_by_pass(block: nn.Module, hidden_size: int) -> bool:
    return invariant_moe._differs_by_pass(block, hidden_size, torch.bfloat16, CPU)


def test_an_moe_block_of_real_width_gives_each_row_its_bits_alone_and_among_others():
    # Qwen3-30B-A3B's widths, 8 of its 128 experts.
    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        nn.init.normal_(param, std=0.02)
    block = block.bfloat16()
    x = spread_values(torch.Generator().manual_seed(5), CPU, torch.bfloat16, 1, 9, 2048)
    with torch.inference_mode():
        eager = block(x)
    weights = (block.experts.gate_up_proj[0], block.experts.down_proj[0], block.gate.weight)
    if any(fewest_rows(weight.detach()) > 1 for weight in weights):  # this CPU's one-row products differ
        assert differs_by_pass(block, 2048)
    assert make_moe_invariant(nn.Sequential(block)) == []
    assert config._experts_implementation == INVARIANT
    if bf16_linear_ready():  # the kernel's products, the stacked weights kept only packed
        assert isinstance(block.experts.invariant_products, PackedExperts) and block.experts.gate_up_proj is None
    else:
        assert isinstance(block.experts.invariant_products, PaddedExperts)
    assert not differs_by_pass(block, 2048)
    with torch.inference_mode():
        ours = block(x)
    assert torch.allclose(ours.float(), eager.float(), rtol=2 ** -7, atol=eager.float().abs().max().item() * 2 ** -7)


@pytest.mark.parametrize("way", ["packed", "padded"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_each_family_s_blocks_compute_what_transformers_experts_forward_does(model_type, way, tmp_path, monkeypatch):
    # Stacked or transposed weights, biases, interleaved gates (GPT-OSS), shared experts, fp32 routers; through the
    # bf16 kernel or oneDNN's padded products.
    if way == "packed" and not bf16_linear_ready():
        pytest.skip("this CPU has no AVX512-BF16")
    if way == "padded":
        monkeypatch.setattr(invariant_moe, "bf16_linear_ready", lambda: False)
    model = AutoModelForCausalLM.from_pretrained(save_tiny(model_type, tmp_path), dtype=torch.bfloat16)
    block, experts, routers = moe_blocks(model)[0]
    assert routers
    hidden = model.config.hidden_size
    x = spread_values(torch.Generator().manual_seed(5), CPU, torch.bfloat16, 1, 7, hidden) * 0.01

    def run() -> torch.Tensor:
        with torch.inference_mode():
            out = block(x)
        return (out[0] if isinstance(out, tuple) else out).float()

    model.config._experts_implementation = "eager"
    eager = run()
    assert make_moe_invariant(model) == []
    assert experts.config._experts_implementation == INVARIANT
    assert isinstance(experts.invariant_products, PackedExperts if way == "packed" else PaddedExperts)
    ours = run()
    assert torch.allclose(ours, eager, rtol=2 ** -6, atol=eager.abs().max().item() * 2 ** -6)
    assert not differs_by_pass(block, hidden)


def test_a_block_whose_rows_no_padding_makes_invariant_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setattr(batch_invariant, "holds_on", lambda *args: True)
    monkeypatch.setattr(invariant_moe, "fewest_rows", lambda weight: None)
    model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3_moe", tmp_path), dtype=torch.bfloat16)
    before = model.config._experts_implementation
    with pytest.raises(ValueError, match="in Qwen3MoeSparseMoeBlock, whose experts' or router's rows no padding"):
        make_invariant("on", model, CPU, torch.bfloat16, False, (4, 2, 8))
    assert not make_invariant("auto", model, CPU, torch.bfloat16, False, (4, 2, 8))
    # Left computing as before.
    assert model.config._experts_implementation == before
    assert all("forward" not in router.__dict__ for _, _, routers in moe_blocks(model) for router in routers)


def test_a_block_that_fails_its_check_gets_its_stacked_weights_back(monkeypatch, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(save_tiny("gpt_oss", tmp_path), dtype=torch.bfloat16)
    stacked = {name: param.detach().clone() for name, param in model.named_parameters() if "experts" in name}
    monkeypatch.setattr(invariant_moe, "_differs_by_pass", lambda *args: True)
    assert make_moe_invariant(model) == ["GptOssMLP"]
    # Packed (on AVX512-BF16 hosts) and unpacked again, transposed layout and all: the same tensors.
    restored = dict(model.named_parameters())
    assert all(torch.equal(restored[name], weight) for name, weight in stacked.items())
    assert all("invariant_products" not in experts.__dict__ for _, experts, _ in moe_blocks(model))
