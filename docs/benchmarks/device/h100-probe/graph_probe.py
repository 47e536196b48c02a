"""A one-off probe, run on an H100 on 2026-11-27 at 71aa732 (with the CPU kernels imported lazily), before
cuda_graphs.py existed: is FlexAttention right on CUDA, and does a whole pass (the model, our attention, the block
masks built inside or outside the capture) replay from a CUDA graph with the logits of the eager pass? Its output
is probe.json beside it; docs/benchmarks/device/README.md reads it. Kept as the record of that measurement: the
engine's graphs are now verifier_service/graphs.py, measured by `speclane bench device`."""
import json
import os
import tempfile
import time
import traceback

import torch

from speclane_cli.bench.device import BLOCK, SHAPES, build_model, copy_bandwidth, engine_rates
from verifier_service.attention import PassContext
from verifier_service.batch import Segment, StepPlan, pass_inputs
from verifier_service.model_runner import ModelRunner
from verifier_service.self_check import largest_difference

OUT = os.environ.get("OUT", "/tmp")
results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
dev = torch.device("cuda")
bw = copy_bandwidth(dev)
results["bw"] = bw / 1e9
T0 = time.time()


def say(**kw):
    print(json.dumps(kw), flush=True)
    results.setdefault("log", []).append(kw)
    with open(f"{OUT}/probe.json", "w") as f:
        json.dump(results, f, indent=1)


def forget_masks(md):
    """The block masks are then built again by the next forward (inside the capture, for mask_inside)."""
    md.block_masks.clear()
    md.inverse_tables = None


def graph_probe(runner, batch, mask_inside):
    ctx = 130
    blocks = -(-(ctx + 1) // BLOCK)
    segs = tuple(Segment(tuple(range(1 + i * blocks, 1 + (i + 1) * blocks)), ctx, 1) for i in range(batch))
    plan = StepPlan((), tuple((7 * i + 11) % 1000 for i in range(batch)), segs)
    ref, _ = runner.run(plan)
    inputs = pass_inputs(plan, dev)
    with torch.inference_mode():
        md = runner.backend.prepare(plan.segments, inputs, runner.cache.block_size, dev)
        context = PassContext(runner.cache, runner.backend, md)

        def fwd():
            return runner.model(input_ids=inputs.input_ids, position_ids=inputs.positions, use_cache=False,
                                logits_to_keep=inputs.logit_rows, speclane_pass=context).logits

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                if mask_inside:
                    forget_masks(md)
                fwd()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            if mask_inside:
                forget_masks(md)
            fwd()
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t) / 10 * 1e3
        if mask_inside:
            forget_masks(md)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fwd()
        g.replay()
        torch.cuda.synchronize()
        diff = (out[0].float() - ref).abs().max().item()
        t = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) / 20 * 1e3
    return dict(batch=batch, mask_inside=mask_inside, eager_forward_ms=round(eager_ms, 3),
                replay_ms=round(replay_ms, 3), max_diff_vs_run=diff)


for name, batches, limit in (("smollm2-135m", (1, 64), 200), ("qwen3-8b", (1, 64), 330)):
    if time.time() - T0 > limit:
        say(skip=name)
        continue
    with tempfile.TemporaryDirectory() as path:
        wb = build_model(SHAPES[name], path, dev, torch.bfloat16)
        runner = ModelRunner(path, "cuda", torch.bfloat16, batch_invariant="off", attention_backend="FLEX_ATTENTION")
        runner.allocate_cache(64 * 12 + 8, BLOCK)
        try:
            d, scale = largest_difference(runner)
            say(model=name, ref_diff=d, weight_gb=wb / 1e9, limit_tok_s=bw / wb)
        except Exception:  # noqa: BLE001 - a probe records each failure and goes on
            say(model=name, ref_error=traceback.format_exc()[-1500:])
        for b in batches:
            for inside in (False, True):
                try:
                    say(model=name, **graph_probe(runner, b, inside))
                except Exception:  # noqa: BLE001 - a probe records each failure and goes on
                    say(model=name, batch=b, inside=inside, graph_error=traceback.format_exc()[-2500:])
                    torch.cuda.synchronize()
        runner.allocate_cache(64, BLOCK)
        for b in batches:
            if time.time() - T0 > limit + 60:
                break
            try:
                say(model=name, flex_engine=engine_rates(runner, b, 8, [3]))
            except Exception:  # noqa: BLE001 - a probe records each failure and goes on
                say(model=name, batch=b, engine_error=traceback.format_exc()[-2500:])
        del runner
        torch.cuda.empty_cache()
say(done=time.time() - T0)
