"""A quantized checkpoint (compressed-tensors W8A8) is served as transformers runs it: its
layers keep their quantized forward, and the engine's passes give transformers' logits.
One it cannot load correctly here is refused at start, in one line."""

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.quantized_support import save_w8a8_llama
from verifier_service.cpu_linear import MeasuredLinear
from verifier_service.model_runner import ModelRunner, UnsupportedModel
from verifier_service.quantization import unsupported_checkpoint

from .architectures import save_tiny
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


@pytest.mark.parametrize("quantization, package, words", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "optimum",
     "gptq checkpoint: Loading a GPTQ quantized model requires"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32}, "gptqmodel",
     "awq checkpoint: Loading an AWQ quantized model requires"),
])
def test_a_checkpoint_whose_quantizer_is_not_installed_is_refused_in_one_line(tmp_path, quantization, package,
                                                                              words):
    if importlib.util.find_spec(package):
        pytest.skip(f"{package} is installed here")
    path = save_tiny("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(UnsupportedModel, match=words) as refusal:
        ModelRunner(path, "cpu", torch.float32)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("device_type, words", [("cpu", "run on Ascend NPUs only"),
                                                ("npu", "quantized matmul is not wired")])
def test_an_msmodelslim_checkpoint_is_refused_by_its_description_file(tmp_path, device_type, words):
    """Its int8 weights would load as float ones with no scales: wrong logits the start-up check cannot see."""
    save_tiny("llama", tmp_path)
    (tmp_path / "quant_model_description_w8a8.json").write_text('{"model_quant_type": "W8A8"}')
    reason = unsupported_checkpoint(str(tmp_path), device_type)
    assert "msModelSlim" in reason and words in reason
    assert unsupported_checkpoint(str(save_tiny("llama", tmp_path / "plain")), device_type) is None
    with pytest.raises(UnsupportedModel, match="msModelSlim"):
        ModelRunner(str(tmp_path), "cpu", torch.float32)
