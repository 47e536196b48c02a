"""Linear-attention layers in the engine: Qwen3-Next's gated delta rule
(Yang et al., "Gated Delta Networks", 2024), whose memory of the past is a
fixed-size state per sequence rather than KV rows.

Each sequence owns a state slot: per linear layer the last K - 1 inputs of
the short convolution and the recurrent matrix S (heads x d_k x d_v, fp32).
A prompt chunk runs the chunked form of the rule (transformers' own) from its
slot and writes the final state back. A decode or verify step (one pending
token, then a draft chain or tree) runs the recurrent form node by node,
each node from its parent's state, and keeps every node's state until the
engine knows which path was accepted: the next pass's plan then names, per
slot, the node whose state to keep (`StateCommit`). So a rejected draft never
touches a sequence's state, as the paged KV cache never serves its rows.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.qwen3_next.modeling_qwen3_next import l2norm, torch_chunk_gated_delta_rule

from verifier_service.batch import Segment, StateCommit


def is_linear_attention(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


@dataclass(frozen=True)
class LinearLayout:
    """Where one pass's segments meet the linear layers, built once per pass.

    Prompt chunks (`chunks`: packed offset, length, slot, fresh) run one at a
    time. Steps run together, padded to `rows` [B, L] packed row indices
    (`valid` marks real ones), each row's parent row (-1: the slot's state),
    and its convolution window `window` [B, L, K]: indices into the slot's K - 1
    stored inputs (0 .. K-2) followed by the step's rows (K-1 ..)."""

    chunks: tuple[tuple[int, int, int, bool], ...]
    slots: torch.Tensor  # [B]
    fresh: torch.Tensor  # [B] bool: no earlier tokens, the state starts at zero
    rows: torch.Tensor
    valid: torch.Tensor
    parents: torch.Tensor
    window: torch.Tensor


def linear_layout(segments: tuple[Segment, ...], offsets: tuple[int, ...], kernel: int,
                  device: torch.device) -> LinearLayout:
    chunks, steps = [], []
    for seg, offset in zip(segments, offsets):
        if seg.num_pending > 1:
            if seg.parents:
                raise ValueError("a prompt chunk cannot carry a draft on a model with linear attention")
            chunks.append((offset, seg.num_pending, seg.state_slot, seg.start == 0))
        else:
            steps.append((seg, offset))
    width = max((seg.num_tokens for seg, _ in steps), default=0)
    rows, valid, parents, window = [], [], [], []
    for seg, offset in steps:
        # Row 0 is the pending token, continuing the slot's state; draft node i is row i + 1.
        parent = [-1] + [p + 1 if p >= 0 else 0 for p in seg.parents]
        parent += [-1] * (width - len(parent))
        rows.append([offset + min(r, seg.num_tokens - 1) for r in range(width)])
        valid.append([r < seg.num_tokens for r in range(width)])
        parents.append(parent)
        window.append([_window(parent, r, kernel) for r in range(width)])
    return LinearLayout(
        tuple(chunks),
        torch.tensor([seg.state_slot for seg, _ in steps], dtype=torch.long, device=device),
        torch.tensor([seg.start == 0 for seg, _ in steps], dtype=torch.bool, device=device),
        torch.tensor(rows, dtype=torch.long, device=device).view(len(steps), width),
        torch.tensor(valid, dtype=torch.bool, device=device).view(len(steps), width),
        torch.tensor(parents, dtype=torch.long, device=device).view(len(steps), width),
        torch.tensor(window, dtype=torch.long, device=device).view(len(steps), width, kernel))


def _window(parent: list[int], row: int, kernel: int) -> list[int]:
    """The K inputs the convolution sees at `row`, oldest first: its own, its
    ancestors' through the draft tree, then the slot's stored inputs."""
    stored = kernel - 1
    chain, at = [], row
    while at >= 0 and len(chain) < kernel:
        chain.append(stored + at)
        at = parent[at]
    column = stored - 1  # the newest stored input
    while len(chain) < kernel:
        chain.append(column)
        column -= 1
    return chain[::-1]


def _project(layer: torch.nn.Module, hidden_states: torch.Tensor):
    """The layer's convolution inputs [T, C] (queries, keys, values), output gate z and the
    decay and rate inputs b, a [T, H_v], from either checkpoint layout: Qwen3-Next's fused
    per-key-head projections, or Qwen3.5's separate ones."""
    if hasattr(layer, "in_proj_qkvz"):
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden_states),
                                                                        layer.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value)], dim=-1)
    else:
        mixed, z = layer.in_proj_qkv(hidden_states), layer.in_proj_z(hidden_states)
        b, a = layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)
    return mixed[0], z[0], b[0], a[0]


class LinearStates:
    """Every sequence slot's state for every linear layer, on one rank."""

    def __init__(self, layers: dict[int, torch.nn.Module], num_slots: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_slots = num_slots
        self.kernel = next(iter(layers.values())).conv_kernel_size  # the same in every layer of a model
        self.conv = {i: torch.zeros(num_slots, m.conv_dim, m.conv_kernel_size - 1, dtype=dtype, device=device)
                     for i, m in layers.items()}
        self.recurrent = {i: torch.zeros(num_slots, m.num_v_heads, m.head_k_dim, m.head_v_dim, device=device)
                          for i, m in layers.items()}
        # Per layer, the last pass's steps: (slots [B], windows [B, L, conv_dim, K-1], states [B, L, H, dk, dv]).
        self._steps: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def bytes_per_slot(layers: dict[int, torch.nn.Module], dtype: torch.dtype) -> int:
        size = torch.finfo(dtype).bits // 8
        return sum(m.conv_dim * (m.conv_kernel_size - 1) * size + m.num_v_heads * m.head_k_dim * m.head_v_dim * 4
                   for m in layers.values())

    def layout(self, segments: tuple[Segment, ...], offsets: tuple[int, ...]) -> LinearLayout:
        """This pass's layout over the states (once per pass, shared by every linear layer)."""
        return linear_layout(segments, offsets, self.kernel, next(iter(self.conv.values())).device)

    def commit(self, commits: tuple[StateCommit, ...]) -> None:
        """Keeps each slot's accepted node from the last pass's steps."""
        if not commits or not self._steps:
            return
        wanted = {c.slot: c.row for c in commits}
        for layer, (slots, windows, states) in self._steps.items():
            pick = [(b, wanted[s]) for b, s in enumerate(slots.tolist()) if s in wanted]
            if not pick:
                continue
            batch = torch.tensor([b for b, _ in pick], device=slots.device)
            row = torch.tensor([r for _, r in pick], device=slots.device)
            self.conv[layer][slots[batch]] = windows[batch, row]
            self.recurrent[layer][slots[batch]] = states[batch, row]
        self._steps = {}

    def forward(self, layer: torch.nn.Module, hidden_states: torch.Tensor, layout: LinearLayout) -> torch.Tensor:
        """One gated DeltaNet layer over the pass's packed tokens [1, T, hidden]."""
        mixed, z, b, a = _project(layer, hidden_states)
        beta = b.sigmoid()
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
        out = torch.zeros(mixed.shape[0], layer.num_v_heads, layer.head_v_dim, device=mixed.device)
        index = layer.layer_idx
        for offset, n, slot, fresh in layout.chunks:
            span = slice(offset, offset + n)
            out[span] = self._chunk(layer, index, mixed[span], g[span], beta[span], slot, fresh)
        if layout.rows.numel():
            out[layout.rows[layout.valid]] = self._steps_forward(layer, index, mixed, g, beta, layout)
        width = layer.head_v_dim
        core = layer.norm(out.to(hidden_states.dtype).reshape(-1, width), z.reshape(-1, width))
        return layer.out_proj(core.reshape(1, mixed.shape[0], -1))

    def _split(self, layer, mixed: torch.Tensor):
        """Convolved [..., C] inputs to query, key [..., H_k, d_k] and value [..., H_v, d_v]."""
        query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        return (query.unflatten(-1, (-1, layer.head_k_dim)), key.unflatten(-1, (-1, layer.head_k_dim)),
                value.unflatten(-1, (-1, layer.head_v_dim)))

    def _chunk(self, layer, index: int, mixed, g, beta, slot: int, fresh: bool) -> torch.Tensor:
        stored = torch.zeros_like(self.conv[index][slot]) if fresh else self.conv[index][slot]
        inputs = torch.cat([stored, mixed.T.to(stored.dtype)], dim=-1)  # [C, K-1+n]
        conv = F.conv1d(inputs[None], layer.conv1d.weight, layer.conv1d.bias, groups=layer.conv_dim)[0]
        self.conv[index][slot] = inputs[:, inputs.shape[1] - stored.shape[1]:]
        query, key, value = self._split(layer, ACT2FN[layer.activation](conv.T))
        initial = None if fresh else self.recurrent[index][slot][None]
        core, final = torch_chunk_gated_delta_rule(query[None], key[None], value[None], g=g[None], beta=beta[None],
                                                   initial_state=initial, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
        self.recurrent[index][slot] = final[0]
        return core[0].float()

    def _steps_forward(self, layer, index: int, mixed, g, beta, layout: LinearLayout) -> torch.Tensor:
        """The steps' rows, node by node from each parent's state; keeps every node's state."""
        slots, fresh = layout.slots, layout.fresh[:, None, None]
        stored = self.conv[index][slots].masked_fill(fresh, 0)  # [B, C, K-1]
        inputs = torch.cat([stored, mixed[layout.rows].transpose(1, 2).to(stored.dtype)], dim=-1)  # [B, C, K-1+L]
        channels = inputs.shape[1]
        windows = torch.gather(inputs[:, :, None, :].expand(-1, -1, layout.window.shape[1], -1), 3,
                               layout.window[:, None].expand(-1, channels, -1, -1))  # [B, C, L, K]
        weight = layer.conv1d.weight[:, 0]  # [C, K]
        conv = (windows * weight[None, :, None, :]).sum(-1)
        if layer.conv1d.bias is not None:
            conv = conv + layer.conv1d.bias[None, :, None]
        query, key, value = self._split(layer, ACT2FN[layer.activation](conv.transpose(1, 2)))  # [B, L, H, d]
        repeat = layer.num_v_heads // layer.num_k_heads
        query = l2norm(query.float().repeat_interleave(repeat, dim=2)) * layer.head_k_dim ** -0.5
        key = l2norm(key.float().repeat_interleave(repeat, dim=2))
        value = value.float()
        decay, rate = g[layout.rows].exp(), beta[layout.rows].float()  # [B, L, H]
        batch, width = layout.rows.shape
        states = torch.empty(batch, width + 1, *self.recurrent[index].shape[1:], device=value.device)
        states[:, 0] = self.recurrent[index][slots].masked_fill(layout.fresh[:, None, None, None], 0)
        out = torch.empty(batch, width, layer.num_v_heads, layer.head_v_dim, device=value.device)
        arange = torch.arange(batch, device=value.device)
        for row in range(width):
            state = states[arange, layout.parents[:, row] + 1] * decay[:, row, :, None, None]
            k, v = key[:, row], value[:, row]
            delta = (v - (state * k[..., None]).sum(-2)) * rate[:, row, :, None]
            state = state + k[..., None] * delta[..., None, :]
            states[:, row + 1] = state
            out[:, row] = (state * query[:, row, ..., None]).sum(-2)
        self._steps[index] = (slots, windows[..., 1:].permute(0, 2, 1, 3), states[:, 1:])
        return out[layout.valid]
