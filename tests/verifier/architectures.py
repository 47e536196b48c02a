"""Tiny random models of each architecture family the verifier serves (or
refuses), saved from transformers' own config classes: dims small enough that
a pass takes milliseconds, features switched on where a family has them
(sliding windows a few tokens wide, strong softcapping, sinks, MoE routing,
MLA's unequal key and value dims, gated DeltaNet layers whose convolution
reaches back past one step's draft)."""

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
# FlexAttention's Triton kernels (CUDA) multiply with matrix instructions that need head dimensions of 16 or more.
HEAD_DIM = 16 if os.environ.get("SPECLANE_TEST_DEVICE", "cpu").startswith("cuda") else 8
WINDOW = 5  # narrower than the tests' prompts, so windowed layers see less than full ones

_COMMON = dict(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_MIXED = ["sliding_attention", "full_attention"]
_DELTANET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4)

# model_type -> config fields over _COMMON
SERVED = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=HEAD_DIM),
    "qwen3_moe": dict(head_dim=HEAD_DIM, decoder_sparse_step=1, **_MOE),
    "mistral": dict(sliding_window=WINDOW, head_dim=HEAD_DIM),
    "phi3": dict(num_key_value_heads=4, sliding_window=WINDOW, pad_token_id=0),
    "gemma2": dict(head_dim=HEAD_DIM, sliding_window=WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=8, layer_types=_MIXED),
    "gemma3_text": dict(head_dim=HEAD_DIM, sliding_window=WINDOW, query_pre_attn_scalar=8, layer_types=_MIXED),
    "gpt_oss": dict(head_dim=HEAD_DIM, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=_MIXED),
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                        topk_group=1, rope_interleave=False),
    "glm4_moe": dict(head_dim=HEAD_DIM, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                     moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    # Gated DeltaNet layers (linear attention, a recurrent state per sequence) between attention layers.
    "qwen3_next": dict(head_dim=HEAD_DIM, layer_types=["linear_attention", "full_attention"], **_MOE, **_DELTANET),
    "qwen3_5_text": dict(head_dim=HEAD_DIM, layer_types=["linear_attention", "full_attention"], **_DELTANET),
}

# model_type -> (config fields over _COMMON, words the refusal must contain)
REFUSED = {
    # Mamba layers (which transformers types "linear_attention" too): a state the engine does not keep.
    "jamba": (dict(num_experts=1, expert_layer_period=2, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
                   mamba_d_conv=2, mamba_expand=1, mamba_dt_rank=4),
              ("jamba", "linear_attention", "recurrent state")),
}


def tiny_config(model_type: str, fields: dict):
    config = AutoConfig.for_model(model_type, **{**_COMMON, **fields})
    # Wider weights than the default make the random models' scores large enough for softcaps and windows to matter.
    config.initializer_range = 0.3
    return config


def save_tiny(model_type: str, path, fields: dict | None = None) -> str:
    fields = SERVED[model_type] if fields is None else fields
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, fields))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)
