"""bf16 linear layers through our AMX kernel (csrc/amx_linear.cc) on Intel
CPUs that have AMX: each row's products are summed in one fixed order, so a
token gets the same bits alone as in any pass. batch_invariant.py takes them
where oneDNN's own bf16 products are not batch-invariant (on AMX no padding
made them so for every shape)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

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


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Two packed weights of the same shape, their output blocks alternating: gate's first, up's first, ..."""
    return torch.stack((gate, up), dim=1).flatten(0, 1).contiguous()


def product(x: torch.Tensor, packed: torch.Tensor, in_features: int, out_features: int, gated: bool) -> torch.Tensor:
    """The kernel's product of x's rows [..., in_features] with packed weights: [..., out_features]."""
    rows = x.reshape(-1, in_features)
    if in_features % BLOCK:  # whole tiles of inputs; the zeros add nothing to a sum
        rows = F.pad(rows, (0, -in_features % BLOCK))
    rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], out_features)
    cpu_kernels().amx_linear(rows.data_ptr(), packed.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1],
                             out_features, gated, torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


class AmxLinear(nn.Module):
    """nn.Linear's computation in bf16, every row's sums in a fixed order, from the weight's tiles. keep_weight:
    the layer keeps the weight itself too (the output layer's: a tied embedding and the draft heads read it)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = (linear.weight if keep_weight else None), linear.bias
        self.packed = pack(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = product(x, self.packed, self.in_features, self.out_features, gated=False)
        return out if self.bias is None else out + self.bias

    def layout_bytes(self) -> int:
        return self.packed.nbytes


class AmxGatedMlp(nn.Module):
    """A SwiGLU MLP (Llama's, Qwen's: down(silu(gate(x)) * up(x))) with its gate and up projections in one
    product whose epilogue applies silu(gate) * up to the fp32 sums: x is read once for both, and the
    activation costs no pass of its own. Rounds once where transformers rounds the two products, the silu and
    the product to bf16, so it is nearer the fp32 computation; its rows are as batch-invariant as AmxLinear's."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.in_features, self.intermediate = mlp.gate_proj.in_features, mlp.gate_proj.out_features
        self.down_proj = AmxLinear(mlp.down_proj)
        # The gate and up weights live only in their tiles: nothing else reads them.
        self.packed = interleave(pack(mlp.gate_proj.weight.detach()), pack(mlp.up_proj.weight.detach()))

    @staticmethod
    def fuses(module: nn.Module) -> bool:
        """Whether `module` is a bias-free SwiGLU MLP of plain bf16 linear layers."""
        linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        return (all(type(linear) is nn.Linear and linear.bias is None and linear.weight.dtype == torch.bfloat16
                    for linear in linears)
                and isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(product(x, self.packed, self.in_features, self.intermediate, gated=True))

    def layout_bytes(self) -> int:
        return self.packed.nbytes  # down_proj counts its own
