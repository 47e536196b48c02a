"""What a bf16 model costs the verifier to load on a CPU: seconds to load (with the batch-invariant mode's checks),
the bytes of its parameters, of its kernels' packed copies (`weight_layout_bytes`) and the process's resident memory
after loading. One model a process, so that resident memory is its own.

    .venv/bin/python docs/benchmarks/bf16/load_memory.py --model qwen2.5-coder-0.5b-instruct
"""

import argparse
import resource
import time

import torch

from speclane.models import DEFAULT_MODEL, resolve_model
from verifier_service.cpu_linear import layout_bytes
from verifier_service.device import set_threads, weights_bytes
from verifier_service.model_runner import ModelRunner

_MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    set_threads(0)
    started = time.perf_counter()
    runner = ModelRunner(str(resolve_model(args.model)), "cpu", torch.bfloat16, batch_invariant="on")
    took = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    with open("/proc/self/status") as status:
        resident = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    print(f"| {args.model} | {took:.1f} | {weights_bytes(runner.model) / _MB:.0f} | "
          f"{layout_bytes(runner.model) / _MB:.0f} | {resident / _MB:.0f} | {peak / _MB:.0f} |")


if __name__ == "__main__":
    main()
