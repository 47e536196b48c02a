"""Qwen2.5-0.5B's linear products in a pass's order (24 layers of q, k, v, o, gate, up, down, then the vocabulary
projection; random bf16 weights of its shapes, 0.99 GB) at 1 to 512 rows, three ways of the batch-invariant mode:
oneDNN's product (`PaddedLinear`, what the mode used before; not invariant on AMX hosts), our AMX kernel
(`AmxLinear`) product by product, and the same with each MLP's gate and up projections in one product with
silu(gate) * up applied in it (`AmxGatedMlp`, what the mode uses; the others leave the activation out). The host's
threads; the ways alternate sweep by sweep; prints the best of `--sweeps` in ms.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/bf16/amx_linear.py
"""

import argparse
import time
from types import SimpleNamespace

import torch
from torch import nn

from verifier_service.amx_linear import AmxGatedMlp, AmxLinear, amx_ready
from verifier_service.batch_invariant import PaddedLinear

LAYERS = 24
SHAPES = [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)] * LAYERS + [
    (151936, 896)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,16,64,256,512")
    parser.add_argument("--sweeps", type=int, default=4)
    args = parser.parse_args()
    if not amx_ready():
        raise SystemExit("this CPU has no AMX-BF16")
    torch.manual_seed(0)
    linears = [nn.Linear(n_in, n_out, bias=False).bfloat16() for n_out, n_in in SHAPES]
    per_layer = len(SHAPES) // LAYERS
    fused = []
    for first in range(0, LAYERS * per_layer, per_layer):
        q, k, v, o, gate, up, down = linears[first:first + per_layer]
        mlp = SimpleNamespace(gate_proj=gate, up_proj=up, down_proj=down)
        fused += [AmxLinear(q), AmxLinear(k), AmxLinear(v), AmxLinear(o), AmxGatedMlp(mlp)]
    ways = {"oneDNN": [PaddedLinear(linear, 1) for linear in linears],
            "AMX kernel": [AmxLinear(linear) for linear in linears],
            "AMX, MLP fused": fused + [AmxLinear(linears[-1])]}
    print(f"threads: {torch.get_num_threads()}\n\n| rows | {' | '.join(ways)} | kernel / oneDNN | fused / oneDNN |\n"
          "|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            inputs = {n: torch.randn(rows, n).bfloat16() for n in {n_in for _, n_in in SHAPES}}
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(args.sweeps):
                for name, layers in ways.items():
                    started = time.perf_counter()
                    for layer in layers:
                        layer(inputs[layer.in_features])
                    best[name] = min(best[name], (time.perf_counter() - started) * 1e3)
            dnn, amx, amx_fused = best.values()
            print(f"| {rows} | {dnn:.1f} | {amx:.1f} | {amx_fused:.1f} | {amx / dnn:.2f}x | {amx_fused / dnn:.2f}x |")


if __name__ == "__main__":
    main()
