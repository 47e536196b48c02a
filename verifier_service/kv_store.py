"""Physical keys and values of every sequence, on every tensor-parallel rank.

Each KV slot holds, per layer, contiguous [kv_heads, capacity, head_dim]
tensors, so attention reads a sequence's cache as a view (no gather per step).
Capacity grows in whole blocks, exactly as the KVPool accounts for them. The
store is changed only by attention writes and by the ops below, which rank 0
decides and every rank applies in the same order.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Free:
    slot: int


@dataclass(frozen=True)
class Keep:
    """Moves rows `start + rows[j]` to `start + j`: compacts an accepted tree path."""

    slot: int
    start: int
    rows: tuple[int, ...]


KVOp = Free | Keep


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


class KVStore:
    def __init__(self, num_layers: int, block_size: int):
        self.num_layers = num_layers
        self.block_size = block_size
        # slot -> per layer (keys, values), created on the first write of that layer
        self._slots: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def apply(self, op: KVOp) -> None:
        if isinstance(op, Free):
            self._slots.pop(op.slot, None)
            return
        rows = torch.tensor([op.start + r for r in op.rows], dtype=torch.long)
        end = op.start + len(op.rows)
        for layer in self._slots.get(op.slot, ()):
            if layer is not None:
                for tensor in layer:
                    tensor[:, op.start:end] = tensor.index_select(1, rows.to(tensor.device))

    def write(self, slot: int, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor):
        """Stores `keys`/`values` [kv_heads, n, head_dim] at rows start..start+n of
        the slot; returns the slot's whole tensors [kv_heads, capacity, head_dim]
        (rows past start + n hold zeros or an earlier step's values)."""
        layers = self._slots.setdefault(slot, [None] * self.num_layers)
        end = start + keys.shape[1]
        current = layers[layer]
        if current is None or current[0].shape[1] < end:
            capacity = round_up(end, self.block_size)
            # Zeros, not empty: batch-invariant attention weights rows past the end by 0, and 0 * NaN is NaN.
            grown = tuple(t.new_zeros(t.shape[0], capacity, t.shape[2]) for t in (keys, values))
            if current is not None:
                for old, new in zip(current, grown):
                    new[:, :start] = old[:, :start]
            layers[layer] = current = grown
        current[0][:, start:end] = keys
        current[1][:, start:end] = values
        return current
