"""Linear layers for fp32 on a CPU that multiply each pass's rows in the way
measured fastest for that many rows.

A verify pass feeds a few to a few dozen tokens (one sequence's draft, or a
batch of decodes). There are three ways to compute x W^T with a BLAS, and
which is fastest depends on the CPU, its BLAS and the rows, by up to 4x:
- `F.linear(x, W)`, PyTorch's own;
- `x @ W_t`, with a second copy of the weight laid out [in, out];
- `(W @ x^T)^T`, the weight as the left operand.
On one x86 CPU (torch 2.13, SmolLM2's MLP projection) F.linear won up to 3
rows and x @ W_t from 4 (4 rows 240 against 160 µs). On an AMD EPYC with one
thread the vocabulary projection took, at 1 / 2 / 4 / 8 rows, 11.2 / 24.6 /
18.6 / 20.2 ms with F.linear, 5.5 / 13.4 / 25.9 / 28.4 with x @ W_t and
11.4 / 5.9 / 8.3 / 13.8 with the weight on the left. So each weight shape's
way is measured when the model loads, per row count; the transposed copy is
kept only where it is chosen for some row count.
"""

import bisect
import time

import torch
import torch.nn.functional as F
from torch import nn

# The row counts measured; a pass of other counts takes the choice of the largest one below it.
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Another way replaces F.linear where it took at most this share of F.linear's time.
_CLEAR_WIN = 0.9
# The weight-first way competes only up to this many rows: from 8 rows, whole passes ran slower
# with it (one sequence and 8 draft tokens: 138-143 against 129 ms) though its single products timed faster.
_WEIGHT_FIRST_MAX_ROWS = 6
# Written between timings to evict the weights: larger than a server CPU's last-level cache.
_SCRATCH_BYTES = 64 << 20


def by_linear(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight)


def by_transposed(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor | None) -> torch.Tensor:
    return x @ weight_t


def by_weight_first(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor | None) -> torch.Tensor:
    # Contiguous: a strided output sends attention's inputs down a slower path (no flash kernel).
    return (weight @ x.t()).t().contiguous()


# The ways, by the index MeasuredLinear.ways holds; by_linear first: the default.
WAYS = (by_linear, by_transposed, by_weight_first)


def _best_seconds(way, x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor, repeats: int,
                  scratch: torch.Tensor) -> float:
    way(x, weight, weight_t)  # a first call pays one-time costs
    times = []
    for _ in range(repeats):
        scratch.add_(1)  # out of the caches, as in a pass, which reads each weight once
        started = time.perf_counter()
        way(x, weight, weight_t)
        times.append(time.perf_counter() - started)
    return min(times)


def way_seconds(weight: torch.Tensor, weight_t: torch.Tensor, scratch: torch.Tensor,
                repeats: int = 3) -> tuple[tuple[float, ...], ...]:
    """For each of MEASURED_ROWS, each way's time (in WAYS' order; best of
    `repeats`, the weights first pushed out of the caches by writing `scratch`)."""
    with torch.inference_mode():
        return tuple(tuple(_best_seconds(way, x, weight, weight_t, repeats, scratch) for way in WAYS)
                     for x in (torch.randn(rows, weight.shape[1], dtype=weight.dtype) for rows in MEASURED_ROWS))


def fastest_ways(seconds: tuple[tuple[float, ...], ...], candidates: tuple[int, ...] = tuple(range(len(WAYS)))
                 ) -> tuple[int, ...]:
    """Per row count of `seconds` (way_seconds', by MEASURED_ROWS), the fastest
    of the `candidates` (indices into WAYS) where it beats F.linear by a clear
    margin: a near tie, which timing noise could decide either way, keeps
    PyTorch's own. The weight-first way only up to _WEIGHT_FIRST_MAX_ROWS."""
    chosen = []
    for rows, times in zip(MEASURED_ROWS, seconds):
        allowed = [way for way in candidates if WAYS[way] is not by_weight_first or rows <= _WEIGHT_FIRST_MAX_ROWS]
        fastest = min(allowed, key=times.__getitem__)
        chosen.append(fastest if times[fastest] < _CLEAR_WIN * times[0] else 0)
    return tuple(chosen)


class MeasuredLinear(nn.Module):
    """nn.Linear's computation, the rows of each pass multiplied in the way
    `ways` (indices into WAYS, per MEASURED_ROWS) says is fastest. Holds
    weight_t = W.T (contiguous) only where by_transposed is among them."""

    def __init__(self, linear: nn.Linear, ways: tuple[int, ...]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.ways = ways
        uses_transposed = WAYS.index(by_transposed) in ways
        self.weight_t = (nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
                         if uses_transposed else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        way = WAYS[self.ways[max(bisect.bisect_right(MEASURED_ROWS, rows) - 1, 0)]]
        out = way(x.reshape(rows, self.in_features), self.weight, self.weight_t)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def replace_linears(model: nn.Module, replacement) -> None:
    """Replaces every nn.Linear in `model` with replacement(linear)."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, replacement(child))


def add_measured_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear in `model` with a MeasuredLinear, its ways
    timed once per weight shape; returns the bytes added (transposed copies)."""
    ways: dict[tuple[int, int], tuple[int, ...]] = {}
    scratch = torch.zeros(_SCRATCH_BYTES // 4)

    def measured(linear: nn.Linear) -> MeasuredLinear:
        shape = tuple(linear.weight.shape)
        if shape not in ways:  # timed on a transposed copy made for the timing
            weight = linear.weight.detach()
            ways[shape] = fastest_ways(way_seconds(weight, weight.t().contiguous(), scratch))
        return MeasuredLinear(linear, ways[shape])

    replace_linears(model, measured)
    return sum(module.weight_t.nbytes for module in model.modules()
               if isinstance(module, MeasuredLinear) and module.weight_t is not None)


def measures_linear_ways(device: torch.device, dtype: torch.dtype, tensor_parallel: bool) -> bool:
    """Only fp32 on a CPU whose PyTorch multiplies with MKL (x86) gains, as
    measured; an ARM build's BLAS is another library, accelerators' GEMMs handle
    either layout, and tensor parallelism shards nn.Linear modules by their type."""
    return (device.type == "cpu" and dtype == torch.float32 and not tensor_parallel
            and torch.backends.mkl.is_available())
