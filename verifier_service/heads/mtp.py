"""Multi-token prediction layer (DeepSeek-V3's MTP, also GLM-4.5, Qwen3-Next,
MiMo): eh_proj over cat(enorm(embedding), hnorm(target's hidden)) into a full
decoder block, read out through its final norm and the shared head. Reused for
every draft step, as vLLM does when k exceeds the number of MTP layers. The
block is our dense layer where the checkpoint's is one (MiMo's), else the
target architecture's own (native_layer.py: MoE, MLA, gated attention)."""

import torch
from torch import nn

from verifier_service.heads.head import FINAL, Head
from verifier_service.heads.layer import DecoderLayer, HeadKV, KVBatch, LayerShape, RMSNorm
from verifier_service.heads.native_layer import native_layer, run_native_layer


class MtpHead(Head):
    kind = "mtp"

    def __init__(self, shape: LayerShape, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None,
                 vocab_size: int, hidden_first: bool = False, native_config: dict | None = None):
        super().__init__(shape, (FINAL,), embed_weight)
        h, eps = shape.hidden_size, shape.rms_norm_eps
        self.enorm = RMSNorm(h, eps, shape.norm_plus_one)
        self.hnorm = RMSNorm(h, eps, shape.norm_plus_one)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        if native_config is None:
            self.layer, self.rotary = DecoderLayer(shape), None
        else:  # the target's config: its architecture's own layer class
            self.layer, self.rotary = native_layer(native_config)
        self.final_norm = RMSNorm(h, eps, shape.norm_plus_one)
        self.hidden_first = hidden_first  # MiMo concatenates [hidden, embedding]
        if lm_head_weight is None:  # the checkpoint carries its own copy of the output layer
            self.head = nn.Linear(h, vocab_size, bias=False)
        else:
            self.lm_head_weight = lm_head_weight.detach()

    def forward(self, token_ids, features, positions, kv: HeadKV | KVBatch, mask=None):
        parts = [self.enorm(self.embed(token_ids)), self.hnorm(features)]
        x = self.eh_proj(torch.cat(parts[::-1] if self.hidden_first else parts, dim=-1))
        if self.rotary is None:
            return self.layer(x, positions, kv, mask=mask)
        return run_native_layer(self.layer, self.rotary, x, positions, kv, mask)

    def logits(self, hidden):
        normed = self.final_norm(hidden)
        return self.head(normed) if hasattr(self, "head") else normed @ self.lm_head_weight.T
