"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a cache of latents.

MLA's keys and values are both made from one compressed latent per token
(`kv_lora_rank` dims, plus `qk_rope_head_dim` of shared rotary key), expanded
per head by `kv_b_proj`. Caching the expansion would take heads x (key + value
dims) per token: 40,960 numbers a layer for DeepSeek-V3, against 576 for the
latent. So in the engine's passes the model hands the latent to the cache
instead (`serve_latent`), and the backends expand the latents they read
(`LayerCall.expand`) right before attending, as vLLM's MLA backends do for
prefill. Outside our passes (the start-up check's reference) the model runs
unchanged.
"""

import torch

from verifier_service.kv_cache import KVGeometry


def is_mla(module: torch.nn.Module) -> bool:
    return hasattr(module, "kv_b_proj") and hasattr(module, "expand_kv")


def latent_geometry(text_config) -> KVGeometry:
    """One latent row per token and layer, the same on every tensor-parallel rank (each expands its own heads)."""
    return KVGeometry(text_config.num_hidden_layers, 1, text_config.kv_lora_rank + text_config.qk_rope_head_dim, 0)


def serve_latent(module: torch.nn.Module, attention_name: str) -> None:
    """Makes the module's `expand_kv` pass the latent through in our passes, and
    gives it `speclane_expand`, which expands latent rows read from the cache."""
    expand_kv = module.expand_kv
    split = [module.kv_lora_rank, module.qk_rope_head_dim]

    def passing_latent(kv_nope: torch.Tensor, k_rot: torch.Tensor):
        if module.config._attn_implementation != attention_name:
            return expand_kv(kv_nope, k_rot)
        latent = torch.cat([kv_nope, k_rot], dim=-1)  # [B, 1, T, rank + rope]: what the cache keeps
        return latent, latent.new_empty(*latent.shape[:-1], 0)

    def expand(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, 1, n, rank + rope] latents -> keys [B, heads, n, key_dim], values [B, heads, n, value_dim]."""
        return expand_kv(*torch.split(latent, split, dim=-1))

    module.expand_kv = passing_latent
    module.speclane_expand = expand
