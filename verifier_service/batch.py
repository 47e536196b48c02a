"""One forward pass over many sequences: the plan rank 0 decides (picklable,
broadcast to the other tensor-parallel ranks) and the flat inputs every rank
derives from it.

The pass is ragged: the sequences' new tokens are packed into one row of
length sum(n_i). Segment i feeds `num_pending` committed tokens not yet in
its KV (a prompt chunk, or just the last committed token) and then its
draft tree. Positions continue the sequence; a draft node's is
last position + depth. Its KV goes to the slots `start, start + 1, ...` of
its block table, whatever the node's depth.
"""

from dataclasses import dataclass

import torch

from verifier_service.block_manager import MoveSlots
from verifier_service.tree import depths


@dataclass(frozen=True)
class StateCommit:
    """Keep, in `slot`, the linear-attention state after row `row` of its step in the last pass."""

    slot: int
    row: int


@dataclass(frozen=True)
class Segment:
    block_table: tuple[int, ...]
    start: int  # tokens already in the sequence's KV
    num_pending: int
    parents: tuple[int, ...] = ()  # draft tree after the pending tokens
    wants_logits: bool = True  # False for a prompt chunk that does not reach the end
    state_slot: int = 0  # the sequence's recurrent state, on models with linear attention (linear_attention.py)

    @property
    def num_tokens(self) -> int:
        return self.num_pending + len(self.parents)

    @property
    def num_logit_rows(self) -> int:
        """The last pending token's row, then one per draft node."""
        return 1 + len(self.parents) if self.wants_logits else 0


@dataclass(frozen=True)
class StepPlan:
    moves: tuple[MoveSlots, ...]  # KV copies to apply before the pass
    input_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    # Linear-attention states to keep from the last pass's steps, before this one (their accepted nodes).
    state_commits: tuple[StateCommit, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def segment_positions(seg: Segment) -> list[int]:
    pending = list(range(seg.start, seg.start + seg.num_pending))
    last = seg.start + seg.num_pending - 1
    return pending + [last + d for d in depths(seg.parents)]


@dataclass(frozen=True)
class PassInputs:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    logit_rows: torch.Tensor  # rows of the pass whose logits are kept, in segment order
    offsets: tuple[int, ...]  # each segment's first row


def pass_layout(plan: StepPlan) -> tuple[list[int], tuple[int, ...], list[int]]:
    """The pass's positions, each segment's first row, and the rows whose logits are kept (in segment order)."""
    positions: list[int] = []
    offsets: list[int] = []
    rows: list[int] = []
    for seg in plan.segments:
        offsets.append(len(positions))
        positions += segment_positions(seg)
        if seg.wants_logits:
            first = offsets[-1] + seg.num_pending - 1
            rows += range(first, first + seg.num_logit_rows)
    return positions, tuple(offsets), rows


def pass_inputs(plan: StepPlan, device: torch.device) -> PassInputs:
    positions, offsets, rows = pass_layout(plan)
    return PassInputs(torch.tensor([plan.input_ids], dtype=torch.long, device=device),
                      torch.tensor([positions], dtype=torch.long, device=device),
                      torch.tensor(rows, dtype=torch.long, device=device), offsets)
