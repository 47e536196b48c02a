"""EAGLE-3 head (Li et al. 2025): fc over three of the target's layers' hidden
states; its one layer attends over cat(norm(embedding), norm(hidden)); its own
norm and lm_head over a reduced draft vocabulary, mapped back to target ids by
d2t (target id = draft id + d2t[draft id]). The layer's residual stream starts
from the hidden state itself (EAGLE-3's paper code), or with
`norm_before_residual` from its normed form (heads made with speculators,
e.g. RedHatAI's; vLLM reads the same config flag)."""

import torch
from torch import nn

from verifier_service.heads.head import Head
from verifier_service.heads.layer import DecoderLayer, HeadKV, KVBatch, LayerShape, RMSNorm


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The hidden states entering layers 2, L/2 and L-3 (EAGLE-3's and vLLM's default)."""
    return 2, num_target_layers // 2, num_target_layers - 3


class Eagle3Head(Head):
    kind = "eagle3"

    def __init__(self, shape: LayerShape, embed_weight: torch.Tensor, aux_layers: tuple[int, ...],
                 draft_vocab_size: int, target_vocab_size: int, norm_before_residual: bool = False):
        super().__init__(shape, tuple(aux_layers), embed_weight)
        self.norm_before_residual = norm_before_residual
        h = shape.hidden_size
        self.fc = nn.Linear(len(aux_layers) * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, shape.rms_norm_eps)
        self.midlayer = DecoderLayer(shape, attention_input_size=2 * h, input_norm=False)
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(target_vocab_size, dtype=torch.bool))

    def forward(self, token_ids, features, positions, kv: HeadKV | KVBatch, mask=None):
        if features.shape[-1] != self.shape.hidden_size:  # the target's aux states, not the head's own output
            features = self.fc(features)
        hidden = self.hidden_norm(features)
        attention_input = torch.cat([self.input_layernorm(self.embed(token_ids)), hidden], -1)
        residual = hidden if self.norm_before_residual else features
        return self.midlayer(residual, positions, kv, attention_input=attention_input, mask=mask)

    def logits(self, hidden):
        return self.lm_head(self.norm(hidden))

    @property
    def draft_token_ids(self):
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
