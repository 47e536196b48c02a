"""bf16 linear layers through our kernel (csrc/bf16_linear.cc) on CPUs with
AVX512-BF16 and no AMX: every pass, each row summed in one order whatever else
the pass holds, from the weight packed as the kernel reads it.

Why: a decode step or a short verify pass reads every weight once, and oneDNN's
bf16 product reads them at a third of the memory's speed (on a 2-core AMD EPYC:
24 GB/s, against 66-75 GB/s for a plain read of the same bytes). Qwen2.5-0.5B's
products in a pass's order took the kernel 0.58x oneDNN's time at one row,
0.55-0.66x up to 32, 0.86-0.96x from 256 rows on (docs/benchmarks/bf16). A
short pass (a decode step of a few sequences, one sequence's verify pass) goes
as one tile of all its rows, streaming each weight once while the tile
multiplies, so up to WIDE_ROWS rows cost about what one does.

Why every pass: bf16 speculation is lossless only with batch-invariant passes
(batch_invariant.py). The kernel sums each output over blocks of BLOCK inputs,
each from zero in the dot-product instruction's order, then the blocks in order,
the bias last: for a row alone as among any others. (Prompt chunks used to go to
oneDNN, so the kernel had to give oneDNN's bits, with oneDNN's undocumented
block found per layer at load; computing every pass needs neither that search
nor a second copy of the weight.)

The weight lives only in its packed copy, except where something else reads it:
the output layer keeps its own (a tied embedding, the draft heads and the
vocabulary's size read it)."""

import torch
from torch import nn

from verifier_service.device import cpu_kernels

LANES = 16  # outputs the kernel's vector holds
BLOCK = 512  # inputs summed from zero before their sum joins the output's (oneDNN's block for most of Qwen2.5's)
# Passes of 2 to this many rows go as one tile of all the rows by 16 outputs, fetching the weights well ahead of
# the tile: Qwen2.5-0.5B's products at 2-16 rows took 0.80-0.96x the time of 4 x 4 tiles (docs/benchmarks/bf16).
WIDE_ROWS = 16
# Passes in tiles of 4 x 4 rows (those over WIDE_ROWS; any, with wide_rows 0) of at least this many rows fetch the
# next weights into cache while the later tiles compute from it, instead of leaving the memory idle: Qwen2.5-0.5B's
# products took 0.77-0.96x the time at 16-128 rows on a 2-core EPYC; with fewer rows, fetching was no faster
# (docs/benchmarks/bf16).
AHEAD_ROWS = 13


def bf16_linear_ready() -> bool:
    """Whether this host runs the kernel: a CPU with AVX512-BF16 and a kernel built for it."""
    try:
        return cpu_kernels().bf16_linear_ready()
    except ImportError:
        return False


def fits(linear: nn.Module) -> bool:
    return fits_weight(linear.weight)


def fits_weight(weight: torch.Tensor) -> bool:
    """Whether the kernel takes weight [..., out, in]: bf16 on a CPU, whole vectors of outputs, pairs of inputs."""
    out, inputs = weight.shape[-2:]
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and out % LANES == 0 and inputs % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [..., out, in] (an MoE's experts stacked in front) as the kernel reads each:
    [..., out / 16][in / 2][16 outputs][2 inputs]."""
    return weight.unflatten(-2, (-1, LANES)).unflatten(-1, (-1, 2)).transpose(-3, -2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: [..., out, in]."""
    return packed.transpose(-3, -2).flatten(-2).flatten(-3, -2)


def product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
            block: int = BLOCK, wide_rows: int = WIDE_ROWS, ahead_rows: int = AHEAD_ROWS) -> torch.Tensor:
    """rows [n, in] (contiguous bf16) times the packed weight: [n, out_features]. wide_rows or ahead_rows 0:
    never one tile, never fetch ahead (the benchmarks' comparisons); the bits are the same any way."""
    out = rows.new_empty(rows.shape[0], out_features)
    cpu_kernels().bf16_linear(rows.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                              out.data_ptr(), rows.shape[0], rows.shape[1], out_features, block, wide_rows, ahead_rows,
                              torch.get_num_threads())
    return out


class StreamedLinear(nn.Module):
    """nn.Linear's computation through the kernel. keep_weight: the layer keeps the unpacked weight too, for what
    reads it; otherwise it is dropped with the nn.Linear."""

    def __init__(self, linear: nn.Linear, keep_weight: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight.detach())
        self.weight, self.bias = (linear.weight if keep_weight else None), linear.bias
        self.wide_rows, self.ahead_rows = WIDE_ROWS, AHEAD_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = product(rows, self.packed, self.bias, self.out_features, BLOCK, self.wide_rows, self.ahead_rows)
        return out.view(*x.shape[:-1], self.out_features)

    def layout_bytes(self) -> int:
        return self.packed.nbytes
