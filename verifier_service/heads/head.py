"""What every head offers the drafting loop. A head maps (token, feature) pairs
to its own hidden states, one position per pair; the feature of a pair is the
target's hidden state at the position before the token (or, on later draft
steps, the head's own output there). Token embeddings and, where the head
shares it, the output layer are the target's own weights, frozen."""

import torch
import torch.nn.functional as F
from torch import nn

from verifier_service.heads.layer import HeadKV, KVBatch, LayerShape

FINAL = -1  # feature layer index: the target's final normed hidden state (the lm_head's input)


class Head(nn.Module):
    kind: str

    def __init__(self, shape: LayerShape, feature_layers: tuple[int, ...], embed_weight: torch.Tensor):
        super().__init__()
        self.shape = shape
        # Indices into the target's hidden states (transformers' output_hidden_states: i is the input of layer i).
        self.feature_layers = feature_layers
        self.embed_weight = embed_weight.detach()  # plain tensor: not a parameter, not saved

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_weight)

    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv: HeadKV | KVBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [n], features [n, F] (F may be the head's hidden size: its own output), -> hidden [n, H].
        `mask` as the layer's attention takes it (a draft tree's rows see their ancestors only)."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [n, V_draft]."""
        raise NotImplementedError

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """Target token id of each draft-vocabulary entry; None when it is the target's vocabulary."""
        return None
