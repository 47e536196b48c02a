"""Attention over the KV store for ragged batches, plugged into the Hugging
Face model through `AttentionInterface`: the model keeps its own weights,
projections and rotary embeddings, and calls this instead of its attention.

The model is run without a transformers cache and this implementation has no
registered mask function, so transformers builds no mask (it would be
dropped anyway); masks come from the ForwardBatch instead.
"""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from verifier_service.batch_invariant import segment_attention

ATTENTION_NAME = "speclane_ragged"


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] for the packed new
    tokens; writes each segment's keys/values to its slot and attends over them."""
    batch = kwargs["speclane_batch"]
    layer = module.layer_idx
    out = torch.empty_like(query)
    for i, (seg, offset, mask) in enumerate(zip(batch.segments, batch.offsets, batch.masks)):
        new = slice(offset, offset + seg.num_tokens)
        keys, values = batch.store.write(seg.slot, layer, seg.start, key[0, :, new], value[0, :, new])
        if batch.key_orders is not None:
            out[0, :, new] = segment_attention(query[0, :, new], keys, values, seg.start, batch.key_orders[i],
                                                scaling if scaling is not None else query.shape[-1] ** -0.5)
            continue
        end = seg.start + seg.num_tokens
        out[:, :, new] = F.scaled_dot_product_attention(
            query[:, :, new], keys[None, :, :end], values[None, :, :end], attn_mask=mask, scale=scaling,
            enable_gqa=keys.shape[0] != query.shape[1],
        )
    return out.transpose(1, 2), None


def register() -> str:
    """Registers the implementation with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION_NAME, ragged_attention)
    return ATTENTION_NAME
