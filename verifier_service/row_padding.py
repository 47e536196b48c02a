"""Padding a product's rows so that each row gets the bits it gets among many: the primitive of the
batch-invariant mode (batch_invariant.py, invariant_moe.py). On x86 CPUs with torch 2.13 (oneDNN), a bf16 product
of fewer than a few rows can take another kernel path than one of many; padded with copies of its first row, it
takes the many-row path. How many rows a weight needs is found by trying (`fewest_rows`)."""

import torch
import torch.nn.functional as F


def at_least_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x ([..., n, features]) with copies of its first row appended up to `rows` rows."""
    missing = rows - x.shape[-2]
    if missing <= 0 or x.shape[-2] == 0:  # no rows: a prompt chunk before the last keeps no logits
        return x
    return torch.cat([x, x[..., :1, :].expand(*x.shape[:-2], missing, x.shape[-1])], dim=-2)


def spread_values(generator: torch.Generator, device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """Values of scales 2^-8 to 2^8: their sums round differently in every order,
    so that a kernel path summing in another order shows in the rounded output."""
    scale = torch.exp2(torch.randint(-8, 9, shape, generator=generator).float())
    return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)


_PADDINGS = (1, 2, 3, 4, 8, 16)


def fewest_rows(weight: torch.Tensor) -> int | None:
    """The fewest rows (1: no padding) a product with `weight` must have for every
    row to get the bits it gets in products of up to 64 rows (checked on random
    rows), or None where no padding in _PADDINGS does."""
    x = spread_values(torch.Generator().manual_seed(0), weight.device, weight.dtype, 64, weight.shape[1])
    with torch.inference_mode():
        for min_rows in _PADDINGS:
            alone = torch.cat([F.linear(at_least_rows(x[i:i + 1], min_rows), weight)[:1] for i in range(64)])
            if all(torch.equal(F.linear(x[:rows], weight), alone[:rows])
                   for rows in sorted({min_rows, 5, 6, 17, 33, 64}) if rows >= min_rows):
                return min_rows
    return None
