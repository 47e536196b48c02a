"""Qwen2.5-0.5B's linear products in a pass's order (24 layers of q, k, v, o, gate, up, down, then the vocabulary
projection; random bf16 weights of its shapes, 0.99 GB) at 1 to 512 rows on a CPU with AVX512-BF16: oneDNN's
product (`PaddedLinear`) against our kernel (`bf16_linear.product`, which the batch-invariant mode takes for every
pass), and the kernel without its one tile of every row for short passes (`wide_rows=0`: tiles of 4 x 4 only). The
host's threads; the ways
alternate sweep by sweep; prints the best of `--sweeps` in ms.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/bf16/bf16_linear.py
"""

import argparse
import time

import torch
from amx_linear import SHAPES  # this folder's AMX script: the same products, in the same order
from torch import nn

from verifier_service.batch_invariant import PaddedLinear
from verifier_service.bf16_linear import StreamedLinear, bf16_linear_ready, product


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,16,64,128,256,512")
    parser.add_argument("--sweeps", type=int, default=4)
    args = parser.parse_args()
    if not bf16_linear_ready():
        raise SystemExit("this CPU has no AVX512-BF16")
    torch.manual_seed(0)
    linears = [nn.Linear(n_in, n_out, bias=False).bfloat16() for n_out, n_in in SHAPES]
    padded = [PaddedLinear(linear, 2) for linear in linears]
    streamed = [StreamedLinear(linear, keep_weight=False) for linear in linears]
    print(f"threads: {torch.get_num_threads()}\n\n"
          "| rows | oneDNN | kernel | kernel / oneDNN | 4 x 4 tiles only | kernel / 4 x 4 tiles |\n"
          "|---|---|---|---|---|---|")

    def by_kernel(layer: StreamedLinear, x: torch.Tensor) -> torch.Tensor:
        return product(x, layer.packed, None, layer.out_features)

    def four_by_four(layer: StreamedLinear, x: torch.Tensor) -> torch.Tensor:
        return product(x, layer.packed, None, layer.out_features, wide_rows=0)

    ways = {"oneDNN": [(linear, PaddedLinear.__call__) for linear in padded],
            "kernel": [(linear, by_kernel) for linear in streamed],
            "4 x 4 tiles": [(linear, four_by_four) for linear in streamed]}
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            inputs = {n: torch.randn(rows, n).bfloat16() for n in {n_in for _, n_in in SHAPES}}
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(args.sweeps):
                for name, layers in ways.items():
                    started = time.perf_counter()
                    for layer, call in layers:
                        call(layer, inputs[layer.in_features])
                    best[name] = min(best[name], (time.perf_counter() - started) * 1e3)
            dnn, kernel, tiled = best.values()
            print(f"| {rows} | {dnn:.1f} | {kernel:.1f} | {kernel / dnn:.2f}x | {tiled:.1f} | "
                  f"{kernel / tiled:.2f}x |")


if __name__ == "__main__":
    main()
