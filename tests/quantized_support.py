"""Tiny quantized checkpoints made with the quantizer's own library: compressed-tensors'
W8A8 preset (int8 weights per output channel, int8 activations per token, quantized
at run time), the format llm-compressor writes and vLLM serves."""

import pathlib

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM, LlamaConfig


def save_w8a8_llama(path: pathlib.Path, vocab_size: int = 96) -> pathlib.Path:
    """A random 2-layer Llama quantized W8A8 (lm_head left in float, as llm-compressor's recipes do)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).eval()
    quantization = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                                      ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, quantization)
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # per-channel min/max, as a calibration's weight observer sets them
            weight = module.weight.detach()
            scale, zero_point = calculate_qparams(weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True),
                                                  module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path
