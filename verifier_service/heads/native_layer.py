"""An MTP layer run by transformers' own decoder-layer class for the target's
architecture: DeepSeek-V3's MLA attention and MoE, GLM-4.5's MoE and partial
rotary, Qwen3-Next's gated attention and MoE. Our dense layer (layer.py)
computes none of these, and writing each again would be a second copy of
transformers' modelling to keep in step; the layer only needs an attention
function that reads and extends the head's own per-sequence KV (HeadKV), which
transformers lets us register, as the engine registers its paged one."""

import importlib
import re

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from verifier_service.heads.layer import HeadKV, KVBatch

HEAD_ATTENTION = "speclane_head"


def head_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, heads, n, d], key/value [1, kv_heads, n, d] of the n new rows, rotated: appended to the
    head's KV, attended over it; returns [1, n, heads, d_v]."""
    kv: HeadKV | KVBatch = kwargs["speclane_head_kv"]
    out = kv.attend(query[0], key[0], value[0], kwargs.get("speclane_head_mask"), scale=scaling)
    return out.transpose(0, 1)[None].to(query.dtype), None


def one_layer_config(target_config: dict):
    """The target's config for a model of one layer that is the MTP layer: full attention, MoE where the
    target's later layers are (DeepSeek-V3 and GLM-4.5 keep their first layers dense; the MTP layer is not)."""
    fields = {**target_config, "num_hidden_layers": 1}
    if "first_k_dense_replace" in fields:
        fields["first_k_dense_replace"] = 0
    if "layer_types" in fields:
        fields["layer_types"] = ["full_attention"]
    if "mlp_only_layers" in fields:
        fields["mlp_only_layers"] = []
    config = AutoConfig.for_model(**fields)
    AttentionInterface.register(HEAD_ATTENTION, head_attention)
    config._attn_implementation = HEAD_ATTENTION
    return config


def native_layer(target_config: dict) -> tuple[nn.Module, nn.Module]:
    """(the decoder layer, the rotary embedding) of the target's architecture, with random weights."""
    config = one_layer_config(target_config)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None or not name.endswith("ForCausalLM"):
        raise ValueError(f"transformers has no causal LM for {config.model_type!r}")
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    prefix = name.removesuffix("ForCausalLM")
    return getattr(module, f"{prefix}DecoderLayer")(config, 0), getattr(module, f"{prefix}RotaryEmbedding")(config)


def run_native_layer(layer: nn.Module, rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                     kv: HeadKV | KVBatch, mask: torch.Tensor | None) -> torch.Tensor:
    """x [n, hidden] at `positions` -> [n, hidden]; `mask` as HeadKV.attend takes it."""
    position_embeddings = rotary(x[None], positions[None])
    return layer(x[None], position_ids=positions[None], position_embeddings=position_embeddings,
                 speclane_head_kv=kv, speclane_head_mask=mask)[0]


def fused_experts(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Checkpoints name each expert's projections (`mlp.experts.E.gate_proj.weight`); transformers' MoE
    modules hold them stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), as
    its loader converts them for these models."""
    pattern = re.compile(rf"^{re.escape(prefix)}mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in tensors.items():
        if m := pattern.match(key):
            experts.setdefault(m.group(2), {})[int(m.group(1))] = value
        else:
            out[key] = value
    if experts:
        def stacked(projection: str) -> torch.Tensor:
            return torch.stack([experts[projection][e] for e in sorted(experts[projection])])

        out[f"{prefix}mlp.experts.gate_up_proj"] = torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1)
        out[f"{prefix}mlp.experts.down_proj"] = stacked("down_proj")
    return out
