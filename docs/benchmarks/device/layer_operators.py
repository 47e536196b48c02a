"""Operators a decode step launches outside the products and attention, with transformers' layers and with the
fused Llama-form layers: the host-independent half of why a CUDA-graph-replayed step on an H100 spent 4 ms beyond
its weight reads (README.md, run 3). Each aten operator that is not a view is one kernel on a GPU; each call of
a fused layer operator is one function inductor compiles (how many Triton kernels it makes of each is for a device
run's profile to show). Counted on a CPU in bf16 with a 36-layer Qwen3 (Qwen3-8B's depth) of small width: the
counts are per layer and do not depend on the width.

    .venv/bin/python docs/benchmarks/device/layer_operators.py
"""

import collections
import tempfile
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen3Config

from verifier_service import model_runner
from verifier_service.batch import Segment, StepPlan
from verifier_service.block_manager import BlockManager, BlockTable
from verifier_service.layer_kernels import TorchKernels
from verifier_service.model_runner import ModelRunner

PRODUCTS = {"mm", "addmm", "bmm", "linear", "matmul", "_weight_int8pack_mm"}


class Count(TorchDispatchMode):
    """aten operators that make a tensor (not a view), by name; none while `paused` (attention's, the fused
    operators')."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An operator in place launches a kernel; `to` a dtype a tensor has returns it, and launches none.
        if not self.paused and (func._schema.is_mutable or not (func.is_view or _aliases(out, args))):
            self.ops[func.overloadpacket.__name__] += 1
        return out


def _aliases(out, args) -> bool:
    storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in storages


def paused(count: Count, function, calls: collections.Counter | None = None, name: str = ""):
    def wrapper(*args, **kwargs):
        if calls is not None:
            calls[name] += 1
        count.paused += 1
        try:
            return function(*args, **kwargs)
        finally:
            count.paused -= 1
    return wrapper


def decode_step(path: str, fused: bool) -> tuple[collections.Counter, collections.Counter, int]:
    count, calls, kernels = Count(), collections.Counter(), TorchKernels(compiled=False)
    for name in ("rms_norm", "add_rms_norm", "silu_mul", "attention_inputs"):
        setattr(kernels, name, paused(count, getattr(kernels, name), calls, name))
    with (mock.patch.object(model_runner, "fuses_layers", lambda *a: fused),
          mock.patch.object(model_runner, "device_kernels", lambda *a: kernels if fused else None)):
        runner = ModelRunner(path, "cpu", torch.bfloat16, batch_invariant="off")
    runner.allocate_cache(64, 16)
    table = BlockTable()
    BlockManager(64, 16, False).allocate(table, [], 40)
    blocks = tuple(table.blocks)
    runner.execute(StepPlan((), tuple(range(3, 35)), (Segment(blocks, 0, 32, ()),)))
    runner.backend.attend = paused(count, runner.backend.attend)
    calls.clear()
    with count:
        runner.execute(StepPlan((), (7,), (Segment(blocks, 32, 1, ()),)))
    return count.ops, calls, runner.model.config.num_hidden_layers


def main() -> None:
    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=36,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=512)
    with tempfile.TemporaryDirectory() as path:
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        for fused in (False, True):
            ops, calls, layers = decode_step(path, fused)
            products = sum(n for name, n in ops.items() if name in PRODUCTS)
            rest = sum(ops.values()) - products
            print(f"\n{'fused layers' if fused else 'transformers layers'}: a decode step's aten operators besides "
                  f"attention, {sum(ops.values())} ({products} products, {rest} others: {rest / layers:.1f} a layer)")
            print("  ", dict(ops.most_common()))
            if fused:
                print(f"   and calls of the fused operators: {dict(calls)} ({sum(calls.values()) / layers:.1f} a "
                      "layer)")


if __name__ == "__main__":
    main()
