"""Which quantized checkpoints the verifier can load, decided before it loads them.

transformers loads a quantized checkpoint through the quantizer its
`quantization_config` names, and refuses one whose kernels' package is missing
with an ImportError (GPTQ: optimum; AWQ: gptqmodel; bitsandbytes): the verifier
turns that into its one-line refusal. msModelSlim's Ascend W8A8 checkpoints
carry no `quantization_config`: transformers would load their int8 weights as
if they were float ones and drop the scales, wrong logits that the start-up
check (which runs the same weights) cannot see, so they are refused by their
description file."""

import pathlib

MSMODELSLIM_DESCRIPTION = "quant_model_description*.json"  # what vllm-ascend recognizes them by


def unsupported_checkpoint(model_dir: str, device_type: str) -> str | None:
    """Why this checkpoint's quantization cannot be served here, in one line, or None."""
    if any(pathlib.Path(model_dir).glob(MSMODELSLIM_DESCRIPTION)):
        where = ("torch_npu's quantized matmul is not wired into the verifier yet" if device_type == "npu"
                 else "they run on Ascend NPUs only")
        return f"msModelSlim quantized checkpoint ({MSMODELSLIM_DESCRIPTION}): {where}; serve the bf16 checkpoint"
    return None


def quantizer_missing(config, error: ImportError) -> str:
    """The refusal for a quantized checkpoint whose quantizer's package transformers did not find."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None)) or "quantized"
    return f"{method} checkpoint: {str(error).strip().splitlines()[0]}"
