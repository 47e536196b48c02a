"""EAGLE-1/2 head (Li et al. 2024): fc over [token embedding, target's final
hidden] into one decoder layer without input norm, read out by the target's
own lm_head."""

import torch
from torch import nn

from verifier_service.heads.head import FINAL, Head
from verifier_service.heads.layer import DecoderLayer, HeadKV, KVBatch, LayerShape


class EagleHead(Head):
    kind = "eagle"

    def __init__(self, shape: LayerShape, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 fc_bias: bool = False):
        super().__init__(shape, (FINAL,), embed_weight)
        self.fc = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=fc_bias)
        self.layer = DecoderLayer(shape, input_norm=False)
        self.lm_head_weight = lm_head_weight.detach()

    def forward(self, token_ids, features, positions, kv: HeadKV | KVBatch, mask=None):
        x = self.fc(torch.cat([self.embed(token_ids), features], dim=-1))
        return self.layer(x, positions, kv, mask=mask)

    def logits(self, hidden):
        return hidden @ self.lm_head_weight.T
