"""A quantized checkpoint (compressed-tensors W8A8) is served as transformers runs it: its
layers keep their quantized forward, and the engine's passes give transformers' logits."""

import torch
from transformers import AutoModelForCausalLM

from tests.quantized_support import save_w8a8_llama
from verifier_service.cpu_linear import MeasuredLinear
from verifier_service.model_runner import ModelRunner

from .test_architectures import BLOCK, assert_passes_equal_transformers


def test_a_w8a8_checkpoint_keeps_its_int8_layers_and_gives_transformers_logits(tmp_path):
    path = save_w8a8_llama(tmp_path / "w8a8")
    runner = ModelRunner(str(path), "cpu", torch.float32)
    projection = runner.model.model.layers[0].self_attn.q_proj
    assert projection.weight.dtype == torch.int8 and not isinstance(projection, MeasuredLinear)
    assert isinstance(runner.model.lm_head, MeasuredLinear)  # left in float by the recipe: measured as usual
    runner.allocate_cache(64, BLOCK, num_state_slots=2)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert_passes_equal_transformers(runner, reference)
