"""torch_npu's fused operators in the model itself, on an Ascend NPU: each
RMSNorm of the Llama form becomes one `npu_rms_norm` call (rms_norm.py), as
vllm-ascend does. Rotary embeddings stay transformers' (a function inside each
model's module, not a layer to swap). Tested on a CPU against an emulation of
the operator; not run on an NPU yet."""

from collections.abc import Callable


def npu_rms_norm(operator: Callable | None = None) -> Callable:
    """torch_npu.npu_rms_norm (or a stand-in with its signature, returning (y, rstd)) as fuse_rms_norms calls a
    norm: (x, weight, epsilon) -> y."""
    if operator is None:
        import torch_npu  # only on an Ascend host: without CANN, importing it breaks torch

        operator = torch_npu.npu_rms_norm
    return lambda x, weight, epsilon: operator(x, weight, epsilon=epsilon)[0]
