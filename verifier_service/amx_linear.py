"""bf16 linear layers through our AMX kernel (csrc/amx_linear.cc) on Intel
CPUs that have AMX: each row's products are summed in one fixed order, so a
token gets the same bits alone as in any pass. batch_invariant.py takes them
where oneDNN's own bf16 products are not batch-invariant (on AMX no padding
made them so for every shape)."""

import torch
import torch.nn.functional as F
from torch import nn

from verifier_service.device import cpu_kernels

TILE_ROWS, BLOCK = 16, 32  # rows and outputs per tile; inputs per tile


def amx_ready() -> bool:
    """Whether this host runs the kernel: a CPU with AMX-BF16, a kernel built for it, the OS's leave to use it."""
    try:
        return cpu_kernels().amx_ready()
    except ImportError:
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 in the kernel's tiles: [out / 16][in / 32][16 input pairs][16 outputs][2],
    zero-padded to whole tiles."""
    out, inputs = weight.shape
    padded = F.pad(weight, (0, -inputs % BLOCK, 0, -out % TILE_ROWS))
    n_blocks, k_blocks = padded.shape[0] // TILE_ROWS, padded.shape[1] // BLOCK
    tiles = padded.view(n_blocks, TILE_ROWS, k_blocks, BLOCK // 2, 2)  # [nb, output, kb, pair, 2]
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


class AmxLinear(nn.Module):
    """nn.Linear's computation in bf16, every row's sums in a fixed order. Holds the weight's tiles beside it
    (the weight itself stays: a tied embedding reads it)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = pack(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        # Whole tiles of rows and inputs; the padding's zeros add nothing to a sum.
        padded = F.pad(rows, (0, -self.in_features % BLOCK, 0, -count % TILE_ROWS)).contiguous()
        out = rows.new_empty(count, self.out_features)
        cpu_kernels().amx_linear(padded.data_ptr(), self.packed.data_ptr(), out.data_ptr(), count,
                                 self.in_features, self.out_features, torch.get_num_threads())
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def layout_bytes(self) -> int:
        return self.packed.nbytes
