"""Linear layers for fp32 on a CPU that also hold their weights transposed
([in, out], contiguous), and pick the faster layout by the rows they are fed.

A verify pass feeds a few to a few dozen tokens (one sequence's draft, or a
batch of decodes). PyTorch's CPU `F.linear(x, W)` multiplies by W transposed,
and from 4 rows on that costs about one weight read per 3 rows; `x @ W_t` with
W_t laid out [in, out] runs as one GEMM (measured on this project's x86 CPU,
torch 2.13, SmolLM2's MLP projection: 4 rows 240 against 160 µs, 8 rows 358
against 173, 15 rows 603 against 246; the vocabulary projection of 13 rows, 29
against 17 ms). Up to 3 rows F.linear reads the weights once and wins (2 rows
123 against 145 µs), and bf16 gains nothing. A verify pass of 13 tokens at 500
tokens of context fell from 160 to 101 ms: speculation on a CPU lives on cheap
draft tokens. The price is a second copy of the linear weights.
"""

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows F.linear's own layout is the faster one.
FEW_ROWS = 3


class TwoLayoutLinear(nn.Module):
    """nn.Linear's computation, with the weight also kept as weight_t = W.T (contiguous)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= FEW_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        out = x @ self.weight_t
        return out if self.bias is None else out + self.bias


def add_transposed_weights(model: nn.Module) -> int:
    """Replaces every nn.Linear in `model` with a TwoLayoutLinear; returns the bytes added."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, TwoLayoutLinear(child))
    return sum(child.weight.nbytes for _, _, child in targets)


def gains_from_transposed_weights(device: torch.device, dtype: torch.dtype, tensor_parallel: bool) -> bool:
    """Only fp32 on a CPU whose PyTorch multiplies with MKL (x86) gains, as
    measured; an ARM build's BLAS is another library, accelerators' GEMMs handle
    either layout, and tensor parallelism shards nn.Linear modules by their type."""
    return (device.type == "cpu" and dtype == torch.float32 and not tensor_parallel
            and torch.backends.mkl.is_available())
