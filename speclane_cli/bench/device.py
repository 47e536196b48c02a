"""`speclane bench device`: the verifier engine on an accelerator, in process,
with no download: random-weight models of real shapes built from their
configs (SmolLM2-135M, Qwen2.5-0.5B, Qwen3-8B), each measured for

- the start-up reference check (the engine's logits against transformers'
  own forward in the serving dtype);
- decode tokens/s with 1 and 64 sequences (speculation off), next to the
  weight-read limit (weight bytes / the device's copy bandwidth, measured here)
  and to transformers' `generate` with a static cache on the same batch;
- the host's share of a pass: how long `execute` takes to return against the
  whole pass, synchronized (a pass the host cannot enqueue faster than the
  device runs it is launch-bound);
- a verify pass of k = 3 and 7 draft tokens per sequence against a decode
  pass: what a draft token costs there, so what speculation can gain.

With --layers fused,transformers each model's engine is measured again with
transformers' own layers and norms on the same weights, so what the fused
layers (verifier_service/fused_layer.py) gain shows in one run.

Random weights make acceptance meaningless, so speculation's own rates come
from the CPU benchmarks; this one measures the engine under them. With
--stack each model is also served through the whole stack and measured over
its HTTP API with none, ngram and suffix (device_stack.py). Decode
rates are differences, (tokens after n steps - after 1) / time, for both
engines, so prefill and warm-up stay out.
"""

import gc
import json
import os
import pathlib
import statistics
import tempfile
import time

import torch

from speclane_cli.bench import device_stack
from verifier_service.config import ATTENTION_BACKENDS
from verifier_service.graphs import capture_sizes

# Real models' shapes (their config.json fields), so that no download is needed.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=100000.0),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     rope_theta=1000000.0),
}
BLOCK = 16
PROMPT_LEN = 128
GRAPH_TOKENS = 512  # the verifier's default --max-batch-tokens: passes up to it replay from CUDA graphs


def add_arguments(parser) -> None:
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda", help="cuda[:N], npu[:N] (with torch_npu) or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", default="1,64", help="comma-separated numbers of sequences")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--drafts", default="3,7", help="draft lengths of the verify passes")
    parser.add_argument("--batch-invariant", default="auto", choices=["auto", "on", "off"],
                        help="the verifier's --batch-invariant (auto: on for 16-bit dtypes on one device)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="the verifier's --attention-backend (a named one turns --batch-invariant auto off)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (as the verifier's flag)")
    parser.add_argument("--cuda-graph-sizes", default="", help="the verifier's flag: tokens of the captured passes")
    parser.add_argument("--layers", default="fused", choices=["fused", "fused,transformers"],
                        help="also measure each model's engine with transformers' own layers and norms, unfused")
    parser.add_argument("--profile", default="", help="write torch.profiler's table of 4 decode steps of each "
                        "model at 1 sequence to files named <this><model>.txt")
    device_stack.add_arguments(parser)
    parser.add_argument("--json", default="", help="also write the results to this file, after every model")


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes/s a device-to-device copy moves, counting bytes read and written (the weight-read limit's unit)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    _sync(device)
    started = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    _sync(device)
    return 2 * source.numel() * 10 / (time.perf_counter() - started)


def build_model(shape: dict, path: str, device: torch.device, dtype: torch.dtype) -> int:
    """Saves a random-weight model of `shape` to `path` (made on the device: fast); returns its weight bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verifier_service.device import weights_bytes

    fields = dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weight_bytes = weights_bytes(model)
    model.save_pretrained(path)
    del model
    return weight_bytes


def _prompts(count: int, vocab: int) -> list[list[int]]:
    return [[(s * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(PROMPT_LEN)] for s in range(count)]


def engine_rates(runner, batch: int, steps: int, drafts: list[int], profile: str = "") -> dict:
    """Decode tokens/s of `batch` sequences, greedy and sampled, the host's share of a decode pass, and verify
    passes' cost."""
    from verifier_service.block_manager import BlockManager
    from verifier_service.engine import Engine
    from verifier_service.sampling import SamplingParams
    from verifier_service.scheduler import BatchLimits
    from verifier_service.sequence import Draft, GenerationParams

    # Steps run: a warm-up, the host-share and profiled passes, three times steps + 2 for decode, and steps + 3
    # for each draft length; a rejected draft commits one token, an accepted one more (the budget trims drafts at
    # the end).
    budget = 2 * (2 + 8 + 4 + 3 * (steps + 2) + (steps + 3) * len(drafts))
    per_seq = PROMPT_LEN + budget + max(drafts) + 1 + BLOCK
    engine = Engine(runner, BlockManager(batch * -(-per_seq // BLOCK), BLOCK, False),
                    BatchLimits(max_tokens=max(batch * PROMPT_LEN, 8192), max_sequences=batch, max_queue_wait=3600))
    params = GenerationParams(max_new_tokens=budget, ignore_eos=True)
    seqs = [engine.open(f"s{i}", p, params) for i, p in enumerate(_prompts(batch, runner.vocab_size))]
    engine.run_together([(seq, Draft()) for seq in seqs])  # prefill

    def timed_steps(count: int, draft_len: int) -> float:
        draft = Draft(tuple(range(3, 3 + draft_len)))  # random weights almost never accept these
        _sync(runner.device)
        started = time.perf_counter()
        for _ in range(count):
            engine.run_together([(seq, draft) for seq in seqs])
        _sync(runner.device)
        return time.perf_counter() - started

    def decode_seconds() -> float:
        """`steps` decode passes' time: a difference of the best of a few runs of each, alternated (as
        transformers_rate's); one run each on a loaded host can leave a difference near zero or below."""
        runs = [(timed_steps(steps + 1, 0), timed_steps(1, 0)) for _ in range(3)]
        return min(long for long, _ in runs) - min(short for _, short in runs)

    timed_steps(2, 0)  # warm
    decode = decode_seconds()
    row = {"sequences": batch, "decode_tokens_per_s": round(batch * steps / decode, 1),
           "decode_step_ms": round(decode / steps * 1e3, 3)}
    # The host's share: a decode pass's time until `execute` returns, against the synchronized whole.
    host, whole = [], []
    execute = runner.execute

    def timed_execute(plan):
        _sync(runner.device)
        started = time.perf_counter()
        out = execute(plan)
        host.append(time.perf_counter() - started)
        _sync(runner.device)
        whole.append(time.perf_counter() - started)
        return out

    runner.execute = timed_execute
    try:
        timed_steps(8, 0)
    finally:
        del runner.execute
    row["pass_host_ms"] = round(statistics.median(host) * 1e3, 3)
    row["pass_ms"] = round(statistics.median(whole) * 1e3, 3)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
        with profiler(activities=activities) as prof:
            timed_steps(4, 0)
        with open(profile, "w") as f:
            # Replayed graphs leave the host little to show: on a GPU the device's kernels are what to read.
            order = "self_cuda_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
            f.write(prof.key_averages().table(sort_by=order, row_limit=30, max_name_column_width=60))
    for k in drafts:
        timed_steps(1, k)  # warm: a pass of a new size may compile (FlexAttention) or plan (cuDNN) first
        verify = timed_steps(steps + 1, k) - timed_steps(1, k)
        row[f"verify_k{k}_step_ms"] = round(verify / steps * 1e3, 3)
        row[f"verify_k{k}_vs_decode"] = round(verify / decode, 3)
    for seq in seqs:
        engine.close(seq)
    # The same decodes sampled (temperature 0.8, unseeded as most requests are, so drawing from the engine's one
    # generator): what judging sampled steps adds to a pass (engine._judge).
    params = GenerationParams(SamplingParams(temperature=0.8), max_new_tokens=budget, ignore_eos=True)
    seqs = [engine.open(f"t{i}", p, params) for i, p in enumerate(_prompts(batch, runner.vocab_size))]
    engine.run_together([(seq, Draft()) for seq in seqs])
    timed_steps(1, 0)
    sampled = decode_seconds()
    row["sampled_decode_tokens_per_s"] = round(batch * steps / sampled, 1)
    row["sampled_vs_greedy"] = round(decode / sampled, 3)
    for seq in seqs:
        engine.close(seq)
    return row


@torch.inference_mode()
def transformers_rate(model, batch: int, steps: int, vocab: int) -> float:
    """Decode tokens/s of transformers' generate with a static cache (SDPA; compiled where transformers compiles
    it by default), the same prompts."""
    ids = torch.tensor(_prompts(batch, vocab), device=model.device)

    def timed(new_tokens: int) -> float:
        _sync(model.device)
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, cache_implementation="static", max_cache_len=ids.shape[1] + steps + 1,
                       pad_token_id=0)
        _sync(model.device)
        return time.perf_counter() - started

    # On CUDA, generate compiles a static cache's decode step, once per cache size: one size for both calls,
    # compiled before the timed ones. The decode steps' time is a difference of two runs, so each is the best of
    # a few, alternated: single runs on a loaded host once gave a negative difference.
    timed(steps + 1)
    runs = [(timed(steps + 1), timed(1)) for _ in range(3)]
    return batch * steps / (min(long for long, _ in runs) - min(short for _, short in runs))


def measure(name: str, shape: dict, path: str, device: torch.device, dtype: torch.dtype, batches: list[int],
            steps: int, drafts: list[int], bandwidth: float, profile: str = "", batch_invariant: str = "auto",
            attention_backend: str = "auto", cuda_graph_sizes: tuple[int, ...] = (),
            unfused_too: bool = False) -> dict:
    """Builds the model of `shape` in `path` and measures the engine on it in process (unfused_too: again with
    transformers' own layers, the same weights, its rows under "transformers_layers")."""
    started = time.perf_counter()
    weight_bytes = build_model(shape, path, device, dtype)
    runner = make_runner(path, device, dtype, batch_invariant, attention_backend, cuda_graph_sizes, fuse=True)
    load_s = time.perf_counter() - started
    result = {"model": name, "vocab_size": shape["vocab_size"], "weight_gb": round(weight_bytes / 1e9, 3),
              "build_and_load_s": round(load_s, 1),
              "attention_backend": runner.backend.name, "fused_layers": runner.fused_layers,
              "cuda_graph_sizes": [size.tokens for size in runner.graphs.sizes] if runner.graphs else [],
              "reference_check": reference_check(runner, dtype),
              "weight_read_limit_tokens_per_s": round(bandwidth / weight_bytes, 1), "batches": []}
    for batch in batches:
        row = engine_rates(runner, batch, steps, drafts, f"{profile}{name}.txt" if profile and batch == 1 else "")
        print(json.dumps({name: row}), flush=True)  # before transformers' compilation, which may run long
        served = runner.model.config._attn_implementation
        runner.model.set_attn_implementation("sdpa")
        try:
            row["transformers_static_tokens_per_s"] = round(transformers_rate(runner.model, batch, steps,
                                                                              runner.vocab_size), 1)
        finally:
            runner.model.set_attn_implementation(served)
        row["vs_transformers"] = round(row["decode_tokens_per_s"] / row["transformers_static_tokens_per_s"], 3)
        if batch == 1:
            row["share_of_weight_read_limit"] = round(row["decode_tokens_per_s"]
                                                      / result["weight_read_limit_tokens_per_s"], 3)
        result["batches"].append(row)
        print(json.dumps({name: row}), flush=True)
    rates = {row["sequences"]: row["decode_tokens_per_s"] for row in result["batches"]}
    if 1 in rates and len(rates) > 1:
        result["largest_batch_vs_one"] = round(rates[max(rates)] / rates[1], 2)
    del runner
    _free(device)
    if unfused_too:
        runner = make_runner(path, device, dtype, batch_invariant, attention_backend, cuda_graph_sizes, fuse=False)
        unfused = {"reference_check": reference_check(runner, dtype), "batches": []}
        for row in result["batches"]:
            theirs = engine_rates(runner, row["sequences"], steps, drafts)
            row["vs_transformers_layers"] = round(row["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 3)
            unfused["batches"].append(theirs)
            print(json.dumps({f"{name} (transformers' layers)": theirs}), flush=True)
        result["transformers_layers"] = unfused
        del runner
        _free(device)
    return result


def make_runner(path: str, device: torch.device, dtype: torch.dtype, batch_invariant: str, attention_backend: str,
                cuda_graph_sizes: tuple[int, ...], fuse: bool):
    from verifier_service.model_runner import ModelRunner

    runner = ModelRunner(path, str(device), dtype, batch_invariant=batch_invariant,
                         attention_backend=attention_backend, cuda_graph_sizes=cuda_graph_sizes, fuse=fuse)
    runner.allocate_cache(64, BLOCK)
    return runner


def reference_check(runner, dtype: torch.dtype) -> dict:
    from verifier_service.self_check import largest_difference, tolerance

    difference, scale = largest_difference(runner)
    return {"max_logit_difference": round(difference, 5), "allowed": round(tolerance(dtype, scale), 5)}


def _free(device: torch.device) -> None:
    """A dropped model's memory back before the next model, or the served one, takes the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> int:
    from speclane.models import copy_tokenizer, resolve_model
    from verifier_service.device import resolve_device

    device = torch.device(resolve_device(args.device))
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device)
    tokenizer = resolve_model(args.tokenizer) if args.stack else None
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
               "torch": torch.__version__, "dtype": args.dtype, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
               "prompt_tokens": PROMPT_LEN, "steps": args.steps, "models": []}
    print(json.dumps({key: value for key, value in results.items() if key != "models"}), flush=True)
    for name in args.models.split(","):
        shape = dict(SHAPES[name])
        if tokenizer is not None:  # served models need a tokenizer: its vocabulary replaces theirs
            shape["vocab_size"] = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
        with tempfile.TemporaryDirectory() as path:
            result = measure(name, shape, path, device, dtype, [int(b) for b in args.batches.split(",")],
                             args.steps, [int(k) for k in args.drafts.split(",")], bandwidth, args.profile,
                             args.batch_invariant, args.attention_backend,
                             () if args.enforce_eager else capture_sizes(args.cuda_graph_sizes, GRAPH_TOKENS),
                             unfused_too=args.layers == "fused,transformers")
            if tokenizer is not None:
                copy_tokenizer(tokenizer, pathlib.Path(path))
                log_dir = pathlib.Path(os.path.dirname(os.path.abspath(args.json)) if args.json else path)
                try:  # a device run is one try: a model the stack fails on leaves the next model's rows
                    result["stack"] = device_stack.served_rates(pathlib.Path(path), str(device),
                                                                log_dir / f"serve-{name}.log", args)
                except (RuntimeError, TimeoutError, OSError) as error:
                    result["stack_error"] = f"{type(error).__name__}: {error}"
        results["models"].append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    return 0
