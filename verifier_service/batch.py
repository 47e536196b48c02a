"""One forward pass over many sequences: the plan rank 0 decides (picklable,
broadcast to the other tensor-parallel ranks) and what every rank derives
from it (flat input, positions, masks, logit rows).

The pass is ragged: the sequences' new tokens are packed into one row of
length sum(n_i). Segment i feeds `num_pending` committed tokens not yet in
its KV (a prompt chunk, or just the last committed token) and then its
draft tree. Positions continue the sequence; a draft node's is
last position + depth.
"""

from dataclasses import dataclass

import torch

from verifier_service.batch_invariant import KeyOrder, key_order
from verifier_service.kv_store import KVOp
from verifier_service.tree import ancestor_mask, depths


@dataclass(frozen=True)
class Segment:
    slot: int
    start: int  # tokens already in the slot's KV
    num_pending: int
    parents: tuple[int, ...] = ()  # draft tree after the pending tokens
    wants_logits: bool = True  # False for a prompt chunk that does not reach the end

    @property
    def num_tokens(self) -> int:
        return self.num_pending + len(self.parents)

    @property
    def num_logit_rows(self) -> int:
        """The last pending token's row, then one per draft node."""
        return 1 + len(self.parents) if self.wants_logits else 0


@dataclass(frozen=True)
class StepPlan:
    ops: tuple[KVOp, ...]  # KV changes to apply before the pass
    input_ids: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def segment_positions(seg: Segment) -> list[int]:
    pending = list(range(seg.start, seg.start + seg.num_pending))
    last = seg.start + seg.num_pending - 1
    return pending + [last + d for d in depths(seg.parents)]


def segment_mask(seg: Segment, device) -> torch.Tensor | None:
    """[n, start + n] bool (True = attend): everything cached, the pending tokens
    causally, and each draft node its ancestors. None when n == 1 (attends all)."""
    n, p = seg.num_tokens, seg.num_pending
    if n == 1:
        return None
    mask = torch.ones(n, seg.start + n, dtype=torch.bool)
    new = mask[:, seg.start:]
    new[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    new[:p, p:] = False
    if seg.parents:
        new[p:, p:] = ancestor_mask(seg.parents)
    return mask.to(device)


@dataclass
class ForwardBatch:
    """What the attention function needs in every layer, built once per pass."""

    store: object  # KVStore
    segments: tuple[Segment, ...]
    offsets: list[int]  # start of each segment in the packed row
    masks: list[torch.Tensor | None]
    key_orders: list[KeyOrder] | None = None  # with batch-invariant attention, which needs no masks


def prepare(plan: StepPlan, store, device, batch_invariant: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    """input_ids [1, T], position_ids [1, T], logit row indices, and the ForwardBatch."""
    positions: list[int] = []
    offsets: list[int] = []
    rows: list[int] = []
    for seg in plan.segments:
        offsets.append(len(positions))
        positions += segment_positions(seg)
        if seg.wants_logits:
            first = offsets[-1] + seg.num_pending - 1
            rows += range(first, first + seg.num_logit_rows)
    ids = torch.tensor([plan.input_ids], dtype=torch.long, device=device)
    pos = torch.tensor([positions], dtype=torch.long, device=device)
    keep = torch.tensor(rows, dtype=torch.long, device=device)
    if batch_invariant:
        batch = ForwardBatch(store, plan.segments, offsets, [None] * len(plan.segments),
                             [key_order(s.num_pending, s.parents, device) for s in plan.segments])
    else:
        batch = ForwardBatch(store, plan.segments, offsets, [segment_mask(s, device) for s in plan.segments])
    return ids, pos, keep, batch
