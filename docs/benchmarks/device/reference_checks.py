"""The start-up reference check of Qwen3-8B's random-weight shape, bf16, with the engine's passes replayed from CUDA
graphs over the default backend (FlexAttention on CUDA, as `speclane bench device` reports it), eager over it,
and eager over TORCH_SDPA: whether the graphs or FlexAttention's kernel add to the difference from transformers'
forward (run 3 measured 0.36 against transformers' eager forward, where 5% of the largest logit was 0.31).

    python3 docs/benchmarks/device/reference_checks.py --device cuda
"""

import argparse
import gc
import json
import tempfile

import torch

from speclane_cli.bench.device import GRAPH_TOKENS, SHAPES, build_model, make_runner, reference_check
from verifier_service.graphs import capture_sizes

VARIANTS = {  # name: (attention backend, replayed from graphs); the bench's own, graphed, last: it captures longest
    "auto, eager": ("auto", False),
    "TORCH_SDPA, eager": ("TORCH_SDPA", False),
    "auto, graphs": ("auto", True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="qwen3-8b", choices=list(SHAPES))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    with tempfile.TemporaryDirectory() as path:
        build_model(SHAPES[args.model], path, device, dtype)
        for name, (backend, graphed) in VARIANTS.items():
            sizes = capture_sizes("", GRAPH_TOKENS) if graphed else ()
            runner = make_runner(path, device, dtype, "auto", backend, sizes, fuse=True)
            print(json.dumps({"model": args.model, "variant": name, "backend": runner.backend.name,
                              **reference_check(runner, dtype)}), flush=True)
            del runner
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
