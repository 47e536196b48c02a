"""The one decoder layer a head runs, in plain torch (Llama/Qwen-style: RMSNorm,
rotary attention, SiLU-gated MLP), with a per-sequence KV cache that a
rollback truncates. Its attention input may be wider than its hidden size
(EAGLE-3 reads cat(embedding, hidden))."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LayerShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 normalizes q and k per head
    norm_plus_one: bool = False  # Qwen3-Next's zero-centred norms scale by (1 + weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if plus_one else torch.ones(size))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight + 1 if self.plus_one else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale


class HeadKV:
    """One sequence's keys and values in a head's layer: [kv_heads, T, head_dim]."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=1)
            self.values = torch.cat([self.values, values], dim=1)
        return self.keys, self.values

    def attention_mask(self, n: int, device) -> torch.Tensor:
        """[n, len] which entries each of the n newest sees: all earlier ones and itself."""
        past = len(self) - n
        return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)

    def truncate(self, length: int) -> None:
        """Rolls back to the first `length` positions (drop the draft steps' entries)."""
        if self.keys is not None and length < len(self):
            self.keys, self.values = self.keys[:, :length], self.values[:, :length]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None = None) -> torch.Tensor:
        """Appends the n new rows' k, v [kv_heads, n, d] and attends q [heads, n, d] over the cache
        (scale: SDPA's, 1 / sqrt(d) when None)."""
        # The cache and the attention over it stay fp32 under a bf16 head: CPU attention over a bf16
        # cache took 3x as long, and the cache is small next to the weights bf16 halves.
        keys, values = self.append(k.float(), v.float())
        if mask is None:
            mask = self.attention_mask(q.shape[1], q.device)
        return F.scaled_dot_product_attention(q.float()[None], keys[None], values[None], attn_mask=mask,
                                              scale=scale, enable_gqa=k.shape[0] != q.shape[0])[0]


class KVBatch:
    """Several sequences' caches behind one batch of rows, sequence i owning the
    next `sizes[i]` rows: the head's linear layers run once over all of them
    (one read of the weights), and each sequence attends over its own cache,
    causally or under its own mask (masks[i], as HeadKV.attend takes it)."""

    def __init__(self, caches: list[HeadKV], sizes: list[int], masks: list[torch.Tensor] | None = None):
        self.caches, self.sizes = caches, sizes
        self.masks = masks or [None] * len(caches)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None = None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("a batch of sequences takes its masks per sequence (KVBatch.masks)")
        return torch.cat([cache.attend(*rows, own_mask, scale) for cache, own_mask, *rows in
                          zip(self.caches, self.masks, q.split(self.sizes, 1), k.split(self.sizes, 1),
                              v.split(self.sizes, 1))], 1)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [heads, n, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class Attention(nn.Module):
    def __init__(self, shape: LayerShape, input_size: int):
        super().__init__()
        s = shape
        self.shape = s
        self.q_proj = nn.Linear(input_size, s.num_heads * s.head_dim, bias=s.attention_bias)
        self.k_proj = nn.Linear(input_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = nn.Linear(input_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, s.norm_plus_one)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, s.norm_plus_one)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: HeadKV | KVBatch,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` [n, cached + n]: which entries each new one sees; None: all earlier ones and itself."""
        s, n = self.shape, x.shape[0]
        q = self.q_proj(x).view(n, s.num_heads, s.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, positions, s.rope_theta), rotate(k, positions, s.rope_theta)
        out = kv.attend(q, k, v, mask)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block. `input_norm=False` drops input_layernorm (EAGLE's
    layer 0); a caller that builds its own attention input (EAGLE-3) passes it
    as `attention_input` and the residual stream as `x`."""

    def __init__(self, shape: LayerShape, attention_input_size: int | None = None, input_norm: bool = True):
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, shape.norm_plus_one)
        self.self_attn = Attention(shape, attention_input_size or shape.hidden_size)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, shape.norm_plus_one)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: HeadKV | KVBatch,
                attention_input: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_input is None:
            attention_input = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(attention_input, positions, kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
