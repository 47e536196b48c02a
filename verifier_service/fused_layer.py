"""Llama-form decoder layers (Llama, Qwen2, Qwen3, Mistral, and Qwen3-MoE's
attention) as a dozen calls rather than the fifty-odd operators and module
calls of transformers' forward, as vLLM's own model code does it:

- q, k and v in one product (`qkv_proj`), gate and up in another (`gate_up_proj`):
  two weights read in one call, through whichever kernel takes the model's
  linear layers (on a CPU: cpu_linear.py in fp32, bf16_linear.py in bf16);
- the norms of each head's query and key (Qwen3), the rotary embedding of both
  and the keys' and values' store into the cache in one operator;
- the residual add and the norm after attention in one; SwiGLU's activation
  in one.

The operators are the device's (layer_kernels.py): our C++ kernels on a CPU,
inductor's on CUDA, torch_npu's on an Ascend NPU. Why: in a SmolLM2 decode step
on two cores the products took 12-14 ms of 18-21, and the rest was not
arithmetic but the layers' 195 us each of operator and module calls; on an
H100, replayed from CUDA graphs, a Qwen3-8B-shaped step spent 4 of its 9.6 ms
of device time outside the weight reads, in small kernels. Ours and inductor's
round where transformers' operators round; torch_npu's compute in fp32 and
round once, as documented, and the start-up check bounds the difference. Every
pass of the engine takes this path on such a layer; the fused products keep the
parts' weights only once: the original projections become views of them
(`Part`), so transformers' own forward, which the start-up check compares the
engine's passes with, still runs."""

import types
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.activations import SiLUActivation

from verifier_service.amx_linear import amx_ready
from verifier_service.attention import PassContext, layer_call
from verifier_service.cpu_linear import is_plain_linear
from verifier_service.layer_kernels import LayerKernels
from verifier_service.rms_norm import LLAMA_FORM_NORMS

# The layers whose forward `_fused_forward` computes: a pre-norm attention block with full-width rotary embeddings
# (Qwen3's with a norm of each head's query and key) and a pre-norm MLP, SwiGLU (fused too) or a mixture of experts
# (Qwen3-MoE's sparse layers: its own forward).
FUSED_LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer",
                          "Qwen3MoeDecoderLayer"})


def fuses_layers(device: torch.device, dtype: torch.dtype) -> bool:
    """On a CPU our kernels take fp32 or bf16, on CUDA inductor's and on an NPU torch_npu's any dtype. On AMX CPUs
    a bf16 SwiGLU MLP runs as one product with its activation (amx_linear.AmxGatedMlp), which the fused gate_up
    product would replace unmeasured, so bf16 layers keep transformers' form there."""
    return device.type in ("cuda", "npu") or (device.type == "cpu" and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and not amx_ready())))


@dataclass(frozen=True)
class LayerShape:
    """A fused layer's attention geometry, read from its config once: a transformers config's attribute reads
    cost a microsecond or more each, and a pass would make them in every layer."""

    heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None  # Mistral's is its config's; Qwen's its module's, set where its layer type is windowed
    qk_norm: bool  # Qwen3: each head's query and key normalized before the rotation
    swiglu: bool  # the MLP is SwiGLU, its gate and up fused; else a mixture of experts, run by its own forward

    @staticmethod
    def of(layer: nn.Module) -> "LayerShape":
        """Of a layer whose projections are fused: its heads are this rank's (under tensor parallelism, a share)."""
        attention = layer.self_attn
        config, q, k, dim = attention.config, attention.q_proj, attention.k_proj, attention.head_dim
        return LayerShape((q.stop - q.start) // dim, (k.stop - k.start) // dim, dim,
                          getattr(attention, "sliding_window", getattr(config, "sliding_window", None)),
                          hasattr(attention, "q_norm"), hasattr(layer.mlp, "gate_up_proj"))


def fuse_decoder_layers(model: nn.Module, kernels: LayerKernels) -> int:
    """Gives every Llama-form decoder layer of `model` the fused forward over `kernels` and its fused products;
    returns how many."""
    layers = [module for module in model.modules() if type(module).__name__ in FUSED_LAYERS and fusable(module)]
    for layer in layers:
        fuse_projections(layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        if is_swiglu(layer.mlp):
            fuse_projections(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        layer.fused_shape = LayerShape.of(layer)
        layer.fused_kernels = kernels
        layer.forward = types.MethodType(_fused_forward, layer)
    return len(layers)


def fusable(layer: nn.Module) -> bool:
    """The attention block's form, and an MLP that is SwiGLU or a mixture of experts (Qwen3-MoE's sparse block)."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    norms = [layer.input_layernorm, layer.post_attention_layernorm,
             *(getattr(attention, name) for name in ("q_norm", "k_norm") if hasattr(attention, name))]
    swiglu = is_swiglu(mlp)
    mlp_weights = [getattr(mlp, name).weight for name in ("gate_proj", "up_proj", "down_proj")] if swiglu else []
    weights = [p.weight for p in projections if p is not None] + [norm.weight for norm in norms] + mlp_weights
    return (all(p is not None and is_plain_linear(p) for p in projections)
            and (swiglu or hasattr(mlp, "experts"))
            and len({weight.dtype for weight in weights}) == 1
            and len({p.bias is None for p in projections[:3]}) == 1
            and all(type(norm).__name__ in LLAMA_FORM_NORMS for norm in norms)
            and attention.head_dim % 2 == 0
            and getattr(attention.config, "partial_rotary_factor", 1.0) == 1.0)


def is_swiglu(mlp: nn.Module) -> bool:
    """act_fn(gate_proj(x)) x up_proj(x) into down_proj, all plain linears, the activation SiLU."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (all(p is not None and is_plain_linear(p) for p in projections)
            and len({p.bias is None for p in projections[:2]}) == 1
            and isinstance(getattr(mlp, "act_fn", None), (SiLUActivation, nn.SiLU)))


class Part(nn.Module):
    """Outputs [start, stop) of the fused product `owner.<name>`: the projection it replaced, for transformers' own
    forward. The owner is held outside the module tree, so the product is one module, measured and replaced once."""

    def __init__(self, owner: nn.Module, name: str, start: int, stop: int):
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.name, self.start, self.stop = name, start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.owner, self.name)(x)[..., self.start:self.stop]


def fuse_projections(owner: nn.Module, fused_name: str, names: tuple[str, ...]) -> None:
    """Makes `owner.<fused_name>` one nn.Linear computing the projections `names` of `owner` side by side; they
    become its Parts. Under tensor parallelism the projections are column shards (transformers' "colwise": each
    rank's output columns, its heads) and the fused product is this rank's shards side by side, a plain Linear that
    returns what the sharded projections returned: this rank's columns."""
    weights = [_local(getattr(owner, name).weight) for name in names]
    biases = [_local(getattr(owner, name).bias) for name in names] if getattr(owner, names[0]).bias is not None else []
    whole = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=bool(biases), device="meta")
    whole.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
    if biases:
        whole.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    setattr(owner, fused_name, whole)
    start = 0
    for name, weight in zip(names, weights):
        setattr(owner, name, Part(owner, fused_name, start, start + weight.shape[0]))
        start += weight.shape[0]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel weight (a DTensor), or the weight."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _fused_forward(layer: nn.Module, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                   position_embeddings=None, **kwargs) -> torch.Tensor:
    context: PassContext | None = kwargs.get("speclane_pass")
    if context is None:  # transformers' reference forward
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   position_embeddings=position_embeddings, **kwargs)
    attention, mlp, kernels, shape = layer.self_attn, layer.mlp, layer.fused_kernels, layer.fused_shape
    x = hidden_states[0]  # [tokens, hidden]
    rows = x.shape[0]
    qk_norm = ((attention.q_norm.weight, attention.k_norm.weight, attention.q_norm.variance_epsilon)
               if shape.qk_norm else None)
    cos, sin = (part[0] for part in position_embeddings)
    q = kernels.attention_inputs(attention.qkv_proj(layer.input_layernorm(x)), shape.heads, shape.kv_heads,
                                 shape.head_dim, qk_norm, cos, sin, context.cache, attention.layer_idx,
                                 context.metadata.slot_mapping)
    attended = context.backend.attend(context.metadata, layer_call(attention, attention.scaling, shape.sliding_window),
                                      q, context.cache)
    norm = layer.post_attention_layernorm
    residual, normed = kernels.add_rms_norm(x, attention.o_proj(attended.reshape(rows, -1)), norm.weight,
                                            norm.variance_epsilon)
    if shape.swiglu:
        out = mlp.down_proj(kernels.silu_mul(mlp.gate_up_proj(normed)))
    else:  # a mixture of experts: its own forward, over [1, tokens, hidden] as transformers' layer calls it
        out = mlp(normed[None])[0]
    return out.add_(residual)[None]
