"""torch_npu's fused operators in the model itself, on an Ascend NPU, as
vllm-ascend calls them: each RMSNorm of the Llama form is one `npu_rms_norm`
(rms_norm.py); in a fused Llama-form layer (fused_layer.py) the residual add
and the norm after attention are one `npu_add_rms_norm`, SwiGLU's activation
one `npu_swiglu`, and the rotary embedding of the queries and of the keys one
`npu_rotary_mul` each. Tested on a CPU against emulations of the operators
(tests/verifier/npu_emulation.py); not run on an NPU yet."""

from types import ModuleType

from verifier_service.layer_kernels import rotated_qkv


class NpuKernels:
    """The layer operators (layer_kernels.LayerKernels) through torch_npu's; the split and reshapes around them, and
    the store into the cache, are torch's."""

    def __init__(self, operators: ModuleType | None = None):
        """operators: torch_npu, or a stand-in with its functions (the tests' emulation)."""
        if operators is None:
            import torch_npu  # only on an Ascend host: without CANN, importing it breaks torch

            operators = torch_npu
        self.operators = operators

    def rms_norm(self, x, weight, epsilon):
        return self.operators.npu_rms_norm(x, weight, epsilon=epsilon)[0]

    def add_rms_norm(self, x, residual, weight, epsilon):
        normed, _, total = self.operators.npu_add_rms_norm(x, residual, weight, epsilon)
        return total, normed

    def silu_mul(self, gate_up):
        return self.operators.npu_swiglu(gate_up.contiguous(), dim=-1)

    def attention_inputs(self, qkv, heads, kv_heads, dim, qk_norm, cos, sin, cache, layer, slots):
        q, k, v = rotated_qkv(qkv, heads, kv_heads, dim, qk_norm, cos, sin, self.rms_norm, self._rotate)
        cache.write(layer, slots, k, v)
        return q

    def _rotate(self, x, cos, sin):
        # The operator takes 4-D tensors: [1, T, heads, dim] (layout BSND) with cos and sin [1, T, 1, dim].
        return self.operators.npu_rotary_mul(x[None], cos[None, :, None], sin[None, :, None])[0]
