"""Linear layers for fp32 on a CPU that also hold their weights transposed
([in, out], contiguous), and pick the faster layout by the rows they are fed.

A verify pass feeds a few to a few dozen tokens (one sequence's draft, or a
batch of decodes). PyTorch's CPU `F.linear(x, W)` multiplies by W transposed;
`x @ W_t` with W_t laid out [in, out] runs another GEMM path, and which is
faster depends on the CPU and its BLAS as much as on the rows. On one x86 CPU
(torch 2.13, SmolLM2's MLP projection) F.linear won up to 3 rows and lost from 4
(4 rows 240 against 160 µs, 15 rows 603 against 246); on an AMD EPYC the
vocabulary projection took 12.9 ms for one row with F.linear and 6.3 with W_t,
and from 4 rows F.linear won. So each weight shape's choice is measured when
the model loads, per row count. The price is a second copy of the linear weights.
"""

import bisect
import time

import torch
import torch.nn.functional as F
from torch import nn

# The row counts measured; a pass of other counts takes the choice of the largest one below it.
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# The transposed layout is taken where it took at most this share of F.linear's time.
_CLEAR_WIN = 0.9
# Written between timings to evict the weights: larger than a server CPU's last-level cache.
_SCRATCH_BYTES = 64 << 20


def _best_seconds(multiply, x: torch.Tensor, weight: torch.Tensor, repeats: int, scratch: torch.Tensor) -> float:
    multiply(x, weight)  # a first call pays one-time costs
    times = []
    for _ in range(repeats):
        scratch.add_(1)  # out of the caches, as in a pass, which reads each weight once
        started = time.perf_counter()
        multiply(x, weight)
        times.append(time.perf_counter() - started)
    return min(times)


def transposed_wins(weight: torch.Tensor, weight_t: torch.Tensor, scratch: torch.Tensor,
                    repeats: int = 3) -> tuple[bool, ...]:
    """For each of MEASURED_ROWS, whether `x @ weight_t` beat `F.linear(x, weight)`
    by a clear margin (best of `repeats` each, the weights first pushed out of
    the caches by writing `scratch`): a near tie, which timing noise could
    decide either way, keeps PyTorch's own layout."""
    wins = []
    with torch.inference_mode():
        for rows in MEASURED_ROWS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            transposed = _best_seconds(torch.matmul, x, weight_t, repeats, scratch)
            wins.append(transposed < _CLEAR_WIN * _best_seconds(F.linear, x, weight, repeats, scratch))
    return tuple(wins)


class TwoLayoutLinear(nn.Module):
    """nn.Linear's computation, with the weight also kept as weight_t = W.T
    (contiguous), used where `wins` (per MEASURED_ROWS) says it is faster."""

    def __init__(self, linear: nn.Linear, wins: tuple[bool, ...]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.wins = wins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self.wins[max(bisect.bisect_right(MEASURED_ROWS, rows) - 1, 0)]:
            return F.linear(x, self.weight, self.bias)
        out = x @ self.weight_t
        return out if self.bias is None else out + self.bias


def add_transposed_weights(model: nn.Module) -> int:
    """Replaces every nn.Linear in `model` with a TwoLayoutLinear, its layouts
    timed once per weight shape; returns the bytes added."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    wins: dict[tuple[int, int], tuple[bool, ...]] = {}
    scratch = torch.zeros(_SCRATCH_BYTES // 4)
    for parent, name, child in targets:
        shape = tuple(child.weight.shape)
        layer = TwoLayoutLinear(child, wins.get(shape, ()))
        if shape not in wins:  # timed on the layer's own transposed copy
            wins[shape] = layer.wins = transposed_wins(layer.weight.detach(), layer.weight_t.detach(), scratch)
        setattr(parent, name, layer)
    return sum(child.weight.nbytes for _, _, child in targets)


def gains_from_transposed_weights(device: torch.device, dtype: torch.dtype, tensor_parallel: bool) -> bool:
    """Only fp32 on a CPU whose PyTorch multiplies with MKL (x86) gains, as
    measured; an ARM build's BLAS is another library, accelerators' GEMMs handle
    either layout, and tensor parallelism shards nn.Linear modules by their type."""
    return (device.type == "cpu" and dtype == torch.float32 and not tensor_parallel
            and torch.backends.mkl.is_available())
