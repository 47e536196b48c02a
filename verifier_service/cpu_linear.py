"""Linear layers for fp32 on a CPU that multiply each pass's rows in the way
measured fastest for that many rows.

A verify pass feeds a few to a few dozen tokens (one sequence's draft, or a
batch of decodes). There are five ways to compute x W^T, and which is fastest
depends on the CPU, its libraries and the rows, by up to 4x:
- `F.linear(x, W)`, PyTorch's own (MKL's GEMM, which repacks W on every call);
- `x @ W_t`, with a second copy of the weight laid out [in, out];
- `(W @ x^T)^T`, the weight as the left operand;
- oneDNN's product with W reordered once, at load, into its blocked layout;
- our kernel (csrc/linear.cc), which reads W in place once per pass, for up
  to a few rows.
On an AMD EPYC with one thread the vocabulary projection took, at 1 / 2 / 4 / 8
rows, 11.2 / 24.6 / 18.6 / 20.2 ms with F.linear, 5.5 / 13.4 / 25.9 / 28.4 with
x @ W_t and 11.4 / 5.9 / 8.3 / 13.8 with the weight on the left. With two
threads, a sweep over all of SmolLM2's products took the kernel 0.80-0.92x the
time of the fastest other way at one to three rows; from four, oneDNN's
reordered weight keeps up with it.

So the ways are measured when the model loads, per weight shape and row count,
in sweeps over all the model's linear layers in a pass's order: each weight then
comes from memory as in a pass. Timed alone, a weight stays in a large last-level
cache (260 MB on one Xeon) and the ranking changes: there the reordered way lost
to x @ W_t weight by weight, and made whole passes of 5-17 rows 11-16% faster.
An extra layout is kept only where some row count uses it. The sweeps take
about 9 s for SmolLM2 on two cores, so their choices are kept between starts
(tuning_cache.py), where no other process disturbed the sweeps.
"""

import bisect
import math
import pathlib
import time
from collections import defaultdict

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from verifier_service import tuning_cache
from verifier_service.device import cpu_kernels

log = structlog.get_logger()

# The row counts measured; a pass of other counts takes the choice of the largest one below it.
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Another way replaces F.linear where it took at most this share of F.linear's time.
_CLEAR_WIN = 0.9
# The weight-first way competes only up to this many rows: from 8 rows, whole passes ran slower
# with it (one sequence and 8 draft tokens: 138-143 against 129 ms) though its single products timed faster.
_WEIGHT_FIRST_MAX_ROWS = 6
# The kernel's tiles hold at most 4 rows (it reuses a tile's weight for more); measured to 8, where GEMMs win.
_KERNEL_MAX_ROWS = 8


# Each way multiplies x [..., in] by W^T, giving [..., out] (contiguous).
def by_linear(x: torch.Tensor, linear: "MeasuredLinear") -> torch.Tensor:
    return F.linear(x, linear.weight)


def by_transposed(x: torch.Tensor, linear: "MeasuredLinear") -> torch.Tensor:
    return x @ linear.weight_t


def by_weight_first(x: torch.Tensor, linear: "MeasuredLinear") -> torch.Tensor:
    # Contiguous: a strided output sends attention's inputs down a slower path (no flash kernel).
    out = (linear.weight @ x.reshape(-1, linear.in_features).t()).t().contiguous()
    return out.view(*x.shape[:-1], linear.out_features)


def by_reordered(x: torch.Tensor, linear: "MeasuredLinear") -> torch.Tensor:
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, linear.in_features), linear.weight_reordered, None,
                                             "none", [], "")
    return out.view(*x.shape[:-1], linear.out_features)


def by_kernel(x: torch.Tensor, linear: "MeasuredLinear") -> torch.Tensor:
    # No reshape or view around the call: at one row they were 2 of the 4.5 us a call spent outside the kernel.
    x = x if x.is_contiguous() else x.contiguous()
    out = x.new_empty(*x.shape[:-1], linear.out_features)
    cpu_kernels().linear(x.data_ptr(), linear.weight.data_ptr(), out.data_ptr(), x.numel() // linear.in_features,
                        linear.in_features, linear.out_features, torch.get_num_threads())
    return out


# The ways, by the index MeasuredLinear.ways holds; by_linear first: the default.
WAYS = (by_linear, by_transposed, by_weight_first, by_reordered, by_kernel)


def reorders() -> bool:
    """Whether this PyTorch can keep a weight in oneDNN's layout (x86 builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def competes(way, rows: int) -> bool:
    """Whether `way` is timed, and may be chosen, for passes of `rows` rows."""
    return ((way is not by_weight_first or rows <= _WEIGHT_FIRST_MAX_ROWS)
            and (way is not by_kernel or rows <= _KERNEL_MAX_ROWS)
            and (way is not by_reordered or reorders()))


class MeasuredLinear(nn.Module):
    """nn.Linear's computation, the rows of each pass multiplied in the way
    `ways` (indices into WAYS, per MEASURED_ROWS) says is fastest. Holds the
    layouts those ways read beside the weight: weight_t = W.T (contiguous) and
    weight_reordered (oneDNN's), each only where a way of `ways` reads it."""

    def __init__(self, linear: nn.Linear, ways: tuple[int, ...] = (0,) * len(MEASURED_ROWS)):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.weight_t: torch.Tensor | None = None
        self.weight_reordered: torch.Tensor | None = None
        self.use(ways)

    def use(self, ways: tuple[int, ...]) -> None:
        """Multiplies by `ways` from now on, holding the layouts they read."""
        self.ways = ways
        self.hold_layouts(ways)
        # The way of every row count up to the largest measured: a lookup per call (a layer's Python overhead
        # is a pass's cost with small layers, as on an accelerator).
        self.way_by_rows = tuple(WAYS[ways[max(bisect.bisect_right(MEASURED_ROWS, rows) - 1, 0)]]
                                 for rows in range(MEASURED_ROWS[-1] + 1))

    def hold_layouts(self, ways) -> None:
        """Adds the layouts the `ways` (indices into WAYS) read; drops the others."""
        used = {WAYS[way] for way in ways}
        weight = self.weight.detach()
        if by_transposed not in used:
            self.weight_t = None
        elif self.weight_t is None:
            self.weight_t = weight.t().contiguous()
        if by_reordered not in used:
            self.weight_reordered = None
        elif self.weight_reordered is None:
            self.weight_reordered = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def layout_bytes(self) -> int:
        """Memory the extra layouts hold (the reordered one counted at the weight's size)."""
        return self.weight.nbytes * ((self.weight_t is not None) + (self.weight_reordered is not None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.way_by_rows[min(x.numel() // self.in_features, MEASURED_ROWS[-1])](x, self)
        return out if self.bias is None else out + self.bias


def sweep_seconds(linears: list[MeasuredLinear], repeats: int = 2) -> dict[tuple[int, int], list[list[float]]]:
    """Per weight shape, per MEASURED_ROWS, each way's time (inf where it does
    not compete): the sum over the layers of that shape in one sweep of all
    `linears` in order, the best of `repeats` sweeps. The layers must hold
    every layout."""
    seconds = defaultdict(lambda: [[math.inf] * len(WAYS) for _ in MEASURED_ROWS])
    one_per_shape = list({tuple(linear.weight.shape): linear for linear in linears}.values())
    with torch.inference_mode():
        for r, rows in enumerate(MEASURED_ROWS):
            inputs = {n: torch.randn(rows, n) for n in {linear.in_features for linear in linears}}
            ways = [(w, way) for w, way in enumerate(WAYS) if competes(way, rows)]
            for _, way in ways:  # a first call per shape pays one-time costs (oneDNN builds a kernel per shape)
                for linear in one_per_shape:
                    way(inputs[linear.in_features], linear)
            for _ in range(repeats):
                for w, way in ways:
                    sweep = defaultdict(float)
                    for linear in linears:
                        started = time.perf_counter()
                        way(inputs[linear.in_features], linear)
                        sweep[tuple(linear.weight.shape)] += time.perf_counter() - started
                    for shape, took in sweep.items():
                        seconds[shape][r][w] = min(seconds[shape][r][w], took)
    return dict(seconds)


def fastest_ways(seconds: list[list[float]]) -> tuple[int, ...]:
    """Per row count of `seconds` (one shape's, by MEASURED_ROWS), the fastest
    way where it beats F.linear by a clear margin: a near tie, which timing
    noise could decide either way, keeps PyTorch's own."""
    chosen = []
    for times in seconds:
        fastest = min(range(len(WAYS)), key=times.__getitem__)
        chosen.append(fastest if times[fastest] < _CLEAR_WIN * times[0] else 0)
    return tuple(chosen)


def replace_linears(model: nn.Module, replacement) -> None:
    """Replaces every plain nn.Linear in `model` with replacement(linear)."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if is_plain_linear(child)]
    for parent, name, child in targets:
        setattr(parent, name, replacement(child))


def is_plain_linear(module: nn.Module) -> bool:
    """An nn.Linear that multiplies its own float weight. A quantized checkpoint's layers (an int8 weight, or
    compressed-tensors' quantizing forward on a float one) keep the forward transformers gave them."""
    return (type(module) is nn.Linear and module.weight.is_floating_point()
            and not hasattr(module, "quantization_scheme"))


def ways_key(linears: list["MeasuredLinear"]) -> dict:
    """What the measured choices depend on: the host, the libraries and our
    kernel's build, the threads, and the layers' shapes in a pass's order."""
    return {**tuning_cache.runtime_key(), "kernels": tuning_cache.file_digest(pathlib.Path(cpu_kernels().__file__)),
            "rows": MEASURED_ROWS, "ways": [way.__name__ for way in WAYS],
            "shapes": [list(linear.weight.shape) for linear in linears]}


def add_measured_linears(model: nn.Module, tuning_dir: pathlib.Path | None = None) -> list:
    """Replaces every nn.Linear in `model` with a MeasuredLinear using the
    ways measured fastest for its shape (or, with `tuning_dir`, those measured at
    an earlier start with the same key, stored only if the cores were quiet
    while they were measured). Returns the choices: [shape, ways] per shape.
    While measuring, every layer holds every layout (three times the weights)."""
    replace_linears(model, MeasuredLinear)
    linears = [module for module in model.modules() if isinstance(module, MeasuredLinear)]
    key = ways_key(linears)
    choices = tuning_cache.load(tuning_dir, "linear-ways", key)
    if choices is not None:
        choices = sorted(choices)  # as measured ones are: the draft-token cost's key holds them
        log.info("linear_ways", source="stored", tuning_dir=str(tuning_dir))
    else:
        every_way = tuple(i for i, way in enumerate(WAYS) if competes(way, 1))
        for linear in linears:
            linear.hold_layouts(every_way)
        with tuning_cache.CoreWatch() as watch:
            measured = {shape: fastest_ways(times) for shape, times in sweep_seconds(linears).items()}
        choices = [[list(shape), list(chosen)] for shape, chosen in sorted(measured.items())]
        log.info("linear_ways", source="measured", tuning_dir=str(tuning_dir), others_share=watch.others_share,
                 stored=tuning_cache.store_measured(tuning_dir, "linear-ways", key, choices, watch))
    ways = {tuple(shape): tuple(chosen) for shape, chosen in choices}
    for linear in linears:
        linear.use(ways[tuple(linear.weight.shape)])
    return choices


def layout_bytes(model: nn.Module) -> int:
    """Memory the weights' extra layouts hold in `model` (MeasuredLinear's, AmxLinear's tiles)."""
    return sum(module.layout_bytes() for module in model.modules() if hasattr(module, "layout_bytes"))


def measures_linear_ways(device: torch.device, dtype: torch.dtype, tensor_parallel: bool) -> bool:
    """Only fp32 on a CPU whose PyTorch multiplies with MKL (x86) gains, as
    measured; an ARM build's BLAS is another library, accelerators' GEMMs handle
    either layout, and tensor parallelism shards nn.Linear modules by their type."""
    return (device.type == "cpu" and dtype == torch.float32 and not tensor_parallel
            and torch.backends.mkl.is_available())
