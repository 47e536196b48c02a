"""bf16 linear layers of up to a few hundred rows through our kernel
(csrc/bf16_linear.cc) on CPUs with AVX512-BF16 and no AMX, with the bits
oneDNN's product gives.

Why: a decode step or a short verify pass reads every weight once, and oneDNN's
bf16 product reads them at a third of the memory's speed (on a 2-core AMD EPYC:
24 GB/s, against 66-75 GB/s for a plain read of the same bytes). Qwen2.5-0.5B's
products in a pass's order took the kernel 0.59x oneDNN's time at one row, 0.67x at
16, 0.95x at 256; a decode step took 0.65x (docs/benchmarks/bf16).

Why the same bits: bf16 speculation is lossless only with batch-invariant passes
(batch_invariant.py), and on these CPUs those are oneDNN's products, padded to a
few rows. Prompt chunks keep them (a GEMM library is the fast way to multiply
hundreds of rows); so the kernel, which takes the passes of up to MAX_ROWS rows,
must give each row what oneDNN gives it. oneDNN sums an output over blocks of
inputs, each block from zero in the dot-product instruction's own order, then
the blocks in order, the bias last. The block depends on the weight's shape (512
inputs for Qwen2.5-0.5B's [4864, 896], 1024 for its [896, 4864]) and is not
published, so it is found when the model loads: the kernel with each candidate
block against oneDNN's padded product, on rows of values whose sums round
differently in every order (`spread_values`), for every weight. A layer where no
candidate gives oneDNN's bits bit for bit keeps oneDNN's product alone.

The kernel reads a copy of the weight packed as its instruction wants it, kept
beside the weight (oneDNN, and a tied embedding, read that one): twice the
linear layers' memory, counted in the model's `weight_layout_bytes`."""

import torch
from torch import nn

from verifier_service.device import cpu_kernels

LANES = 16  # outputs the kernel's vector holds
# The kernel takes passes of up to this many rows, prompt chunks above it go to oneDNN: on the EPYC it was faster
# than oneDNN at every row count measured, but only 0.95-0.97x the time from 256 rows on, and the load-time check
# multiplies up to this many rows for every layer.
MAX_ROWS = 256
BLOCKS = (512, 1024, 256, 2048, 128)  # candidates for oneDNN's block of inputs, the likelier first
_CHECKED_ROWS = (1, 2, 3, 4, 5, 8, 13, 16, 33, 64, 130, MAX_ROWS)  # every tile shape of the kernel (4 rows a tile)
# Passes of at least this many rows (4 tiles of 4 rows, one for each 16 outputs of a tile) fetch the next weights
# into cache while the later tiles compute from it, instead of leaving the memory idle: Qwen2.5-0.5B's products took
# 0.77-0.96x the time at 16-128 rows on a 2-core EPYC; with fewer rows, fetching was no faster (docs/benchmarks/bf16).
AHEAD_ROWS = 13


def bf16_linear_ready() -> bool:
    """Whether this host runs the kernel: a CPU with AVX512-BF16 and a kernel built for it."""
    try:
        return cpu_kernels().bf16_linear_ready()
    except ImportError:
        return False


def fits(linear: nn.Module) -> bool:
    return (linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"
            and linear.out_features % LANES == 0 and linear.in_features % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] as the kernel reads it: [out / 16][in / 2][16 outputs][2 inputs]."""
    out, inputs = weight.shape
    return weight.view(out // LANES, LANES, inputs // 2, 2).permute(0, 2, 1, 3).contiguous()


def product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
            block: int, ahead_rows: int = AHEAD_ROWS) -> torch.Tensor:
    """rows [n, in] (contiguous bf16) times the packed weight: [n, out_features]. ahead_rows 0: never fetch
    ahead (the benchmarks' comparison); the bits are the same either way."""
    out = rows.new_empty(rows.shape[0], out_features)
    cpu_kernels().bf16_linear(rows.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                              out.data_ptr(), rows.shape[0], rows.shape[1], out_features, block, ahead_rows,
                              torch.get_num_threads())
    return out


class StreamedLinear(nn.Module):
    """A PaddedLinear whose passes of up to MAX_ROWS rows go through the kernel, with `block`, the one found
    to give oneDNN's bits (`of` finds it, or keeps the PaddedLinear)."""

    def __init__(self, padded: nn.Module, packed: torch.Tensor, block: int):
        super().__init__()
        self.in_features, self.out_features = padded.in_features, padded.out_features
        self.padded, self.packed, self.block = padded, packed, block
        self.ahead_rows = AHEAD_ROWS
        self.weight, self.bias = padded.weight, padded.bias

    @staticmethod
    def of(padded: nn.Module, probe: torch.Tensor, found: dict[tuple, int]) -> nn.Module:
        """`padded` (a PaddedLinear that `fits`) streamed where some block gives its bits on the probe's rows
        (MAX_ROWS of them, values whose sums round differently in every order), at every row count; else `padded`
        itself. found: the blocks found for earlier layers, by shape, tried first (a model's layers share a few
        shapes)."""
        packed = pack(padded.weight.detach())
        bias = None if padded.bias is None else padded.bias.detach().contiguous()
        shape = (padded.out_features, padded.in_features, bias is not None)

        def matching(blocks: list[int]) -> list[int]:
            # Without the bias too: a large bias can hide a block's rounding.
            for with_bias in {None, bias}:
                expected = padded.rows_product(probe, with_bias)
                blocks = [block for block in blocks
                          if all(torch.equal(product(probe[:rows], packed, with_bias, padded.out_features, block),
                                             expected[:rows]) for rows in _CHECKED_ROWS)]
            return blocks

        with torch.inference_mode():
            blocks = (shape in found and matching([found[shape]])) or matching([*BLOCKS, padded.in_features])
        if not blocks:
            return padded
        found[shape] = blocks[0]
        return StreamedLinear(padded, packed, blocks[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_ROWS:
            return self.padded(x)
        out = product(rows.contiguous(), self.packed, self.bias, self.out_features, self.block, self.ahead_rows)
        return out.view(*x.shape[:-1], self.out_features)

    def layout_bytes(self) -> int:
        return self.packed.nbytes

