"""torch_npu's fused operators in the model itself, on an Ascend NPU, as
vllm-ascend calls them: each RMSNorm of the Llama form is one `npu_rms_norm`
(rms_norm.py); in a fused Llama-form layer (fused_layer.py) the residual add
and the norm after attention are one `npu_add_rms_norm`, SwiGLU's activation
one `npu_swiglu`, and the rotary embedding of the queries and of the keys one
`npu_rotary_mul` each. Tested on a CPU against emulations of the operators
(tests/verifier/npu_emulation.py); not run on an NPU yet."""

from types import ModuleType


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
        rows = qkv.shape[0]
        q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
        q, k, v = q.reshape(rows, heads, dim), k.reshape(rows, kv_heads, dim), v.reshape(rows, kv_heads, dim)
        if qk_norm is not None:
            q_weight, k_weight, epsilon = qk_norm
            q, k = self.rms_norm(q, q_weight, epsilon), self.rms_norm(k, k_weight, epsilon)
        # The operator takes 4-D tensors: [1, T, heads, dim] (layout BSND) with cos and sin [1, T, 1, dim].
        cos, sin = cos[None, :, None], sin[None, :, None]
        q, k = (self.operators.npu_rotary_mul(x[None], cos, sin)[0] for x in (q, k))
        cache.write(layer, slots, k, v)
        return q
