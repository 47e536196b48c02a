"""Rank processes. Rank 0 (the gRPC server) builds its engine here and spawns
ranks 1..N-1 as `python -m verifier_service.workers`; those join the process
group, load their shard and run every plan rank 0 broadcasts, until it
broadcasts None (or dies)."""

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys

import structlog
import torch
import torch.distributed as dist
from transformers import AutoConfig
from transformers.utils import logging as transformers_logging

from speclane.config import settable_fields
from speclane.fetch import speclane_home
from speclane.log import configure_logging
from speclane.net import free_port
from verifier_service import tuning_cache
from verifier_service.batch import Segment, StepPlan
from verifier_service.block_manager import BlockManager
from verifier_service.config import VerifierConfig
from verifier_service.device import (
    Memory,
    auto_cpu_bf16,
    cpu_has_native_bf16,
    draft_limit,
    free_memory_bytes,
    kv_cache_blocks,
    resolve_device,
    resolve_dtype,
    resolve_head_precision,
    set_threads,
    total_memory_bytes,
    weights_bytes,
)
from verifier_service.distributed import (
    TensorParallel,
    check_shardable,
    exit_with_parent,
    init_tensor_parallel,
    rank_device,
)
from verifier_service.draft_cost import stored_or_measured_token_costs
from verifier_service.engine import Engine
from verifier_service.graphs import capture_sizes
from verifier_service.heads.capture import HiddenStateCapture
from verifier_service.heads.loading import load_head
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits
from verifier_service.self_check import check_against_reference
from verifier_service.sequence import GenerationParams

log = structlog.get_logger()
_FOLLOWER_STOP_SECONDS = 30


def build_runner(config: VerifierConfig, device: str, tp: TensorParallel | None) -> ModelRunner:
    if tp is not None:
        model_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        check_shardable(model_config.get_text_config(), tp.world_size)
        device = rank_device(device, tp.rank)
    return ModelRunner(config.model, device, served_dtype(config, device), tp=tp,
                       max_model_len=config.max_model_len, trust_remote_code=config.trust_remote_code,
                       batch_invariant=config.batch_invariant, attention_backend=config.attention_backend,
                       tuning_dir=tuning_dir(config),
                       cuda_graph_sizes=() if config.enforce_eager else capture_sizes(config.cuda_graph_sizes,
                                                                                      config.max_batch_tokens))


def served_dtype(config: VerifierConfig, device: str) -> torch.dtype:
    return resolve_dtype(config.dtype, device, cpu_bf16=auto_cpu_bf16(
        cpu_has_native_bf16(), config.tensor_parallel_size, config.batch_invariant, config.attention_backend))


def batch_limits(config: VerifierConfig, device: str) -> BatchLimits:
    """The engine's limits on a pass, with the device's own on a step's draft (warned of once, at start)."""
    limits = BatchLimits(config.max_batch_tokens, config.max_batch_sequences, config.max_queue_wait,
                         draft_limit(device))
    if limits.max_draft_tokens:
        log.warning("draft_tokens_cut", device=device, max_draft_tokens=limits.max_draft_tokens,
                    setting="num_speculative_tokens",
                    action=f"each step verifies at most {limits.max_draft_tokens} draft tokens of a sequence (this "
                           f"device takes at most {limits.max_draft_tokens + 1} tokens per sequence a pass, as in "
                           "vllm-ascend); longer drafts and trees are cut, never rejected")
    return limits


def tuning_dir(config: VerifierConfig) -> pathlib.Path | None:
    return speclane_home() / "tuning" if config.tuning_cache else None


def _pass_cost_key(config: VerifierConfig, runner: ModelRunner) -> dict:
    """What a pass's cost depends on beyond the code: the host, the model and how it is served (on fp32 CPU
    passes, the ways to multiply that this start measured or read)."""
    model_config = pathlib.Path(runner.model_dir, "config.json")
    return {**tuning_cache.runtime_key(), "device": str(runner.device), "dtype": str(runner.dtype),
            "tp": runner.tp_size,
            "model": tuning_cache.file_digest(model_config) if model_config.is_file() else runner.model_dir,
            "batch_invariant": runner.batch_invariant, "attention": runner.backend.name,
            "linear_ways": runner.linear_ways,
            "head": [config.draft.head_method, config.draft.head_model, config.head_dtype, repr(config.draft.tree)],
            "max_batch_tokens": config.max_batch_tokens}


def _measure_memory(runner: ModelRunner, limits: BatchLimits, block_size: int) -> Memory:
    """This rank's memory once the weights (and a head) are in. On an accelerator
    the activations' peak is profiled with a pass of the most tokens a pass may
    have, on a throwaway cache."""
    where = str(runner.device)
    activations = 0
    if runner.device.type != "cpu":
        backend = getattr(torch, runner.device.type)  # torch.cuda, or torch.npu once torch_npu is imported
        tokens = min(limits.max_tokens, runner.max_context_len - 1)
        runner.allocate_cache(-(-tokens // block_size), block_size)
        backend.synchronize()
        before = backend.memory_allocated()
        backend.reset_peak_memory_stats()
        table = tuple(range(runner.cache.num_blocks))
        runner.execute(StepPlan((), (0,) * tokens, (Segment(table, 0, tokens),)))
        backend.synchronize()
        activations = backend.max_memory_allocated() - before
        runner.cache = None
    return Memory(total_memory_bytes(where), free_memory_bytes(where), weights_bytes(runner.model), activations)


def warm_up(engine: Engine) -> None:
    """One throwaway step, so the first request pays no lazy-init cost."""
    seq = engine.open("warm-up", [0], GenerationParams(max_new_tokens=1, ignore_eos=True))
    engine.prefill(seq)
    engine.close(seq)


class Rank0:
    """Builds the serving engine (on the model thread) and owns the follower processes."""

    def __init__(self, config: VerifierConfig, on_step=None):
        self.config = config
        self.on_step = on_step
        self.tp: TensorParallel | None = None
        self.followers: list[subprocess.Popen] = []

    def load(self) -> Engine:
        """The engine. Where --dtype auto chose bf16 on a CPU but its passes are not batch-invariant or fail the
        start-up check (attention the invariant mode does not compute, logits beyond bf16's bound), the engine in
        fp32: auto never serves a bf16 whose speculation could change an output, nor refuses what fp32 serves."""
        config, device = self.config, resolve_device(self.config.device)
        if not (device == "cpu" and config.dtype == "auto" and served_dtype(config, device) == torch.bfloat16):
            return self._load(config, device)
        try:  # --batch-invariant on: the mode itself refuses, with the reason, what it cannot make invariant
            return self._load(dataclasses.replace(config, batch_invariant="on"), device)
        except ValueError as exc:  # outside this block, the failed engine's frames are freed before the next load
            reason = str(exc)
        log.warning("dtype_fallback", dtype="float32", reason=reason)
        self.config = dataclasses.replace(config, dtype="float32")
        return self._load(self.config, device)

    def _load(self, config: VerifierConfig, device: str) -> Engine:
        if config.tensor_parallel_size > 1:
            model_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
            check_shardable(model_config.get_text_config(), config.tensor_parallel_size)
            port = free_port()
            self.followers = [_spawn(config, rank, port) for rank in range(1, config.tensor_parallel_size)]
            self.tp = init_tensor_parallel(device, 0, config.tensor_parallel_size, port)
        runner = build_runner(config, device, self.tp)
        # The head runs on rank 0 only (draft_tensor_parallel_size 1, as in vLLM), loaded before the KV cache
        # is sized, so that its memory is not counted twice.
        draft = config.draft
        head = (load_head(draft.head_method, draft.head_model, runner,
                          resolve_head_precision(config.head_dtype, runner.device.type, runner.dtype), draft.tree)
                if draft.head_method else None)
        limits = batch_limits(config, str(runner.device))
        block_bytes = runner.kv_bytes_per_token * config.kv_block_size
        num_blocks = kv_cache_blocks(accelerator=runner.device.type != "cpu", block_bytes=block_bytes,
                                     memory=_measure_memory(runner, limits, config.kv_block_size),
                                     gpu_memory_utilization=config.gpu_memory_utilization,
                                     kv_cache_space_gib=config.kv_cache_space,
                                     num_blocks_override=config.num_gpu_blocks_override,
                                     state_bytes=runner.state_bytes_per_slot * limits.max_sequences)
        # A captured prompt needs every position's hidden states: none may come from the prefix cache. Nor may
        # a linear-attention model's, whose states are kept per sequence, not per block.
        blocks = BlockManager(num_blocks, config.kv_block_size,
                              config.enable_prefix_caching and not config.draft.capture_dir
                              and not runner.linear_layers)
        engine = Engine(runner, blocks, limits, on_step=self.on_step, head=head)
        log.info("kv_cache_ready", num_blocks=blocks.num_blocks, block_size=blocks.block_size,
                 max_kv_tokens=blocks.max_tokens, bytes_per_token=runner.kv_bytes_per_token,
                 prefix_caching=blocks.enable_prefix_caching)
        runner.capture_graphs()  # before the check, which then runs the passes as they will be served
        check_against_reference(runner, refuse=config.reference_check == "refuse")  # on every rank
        warm_up(engine)
        # Measured with or without a head: the gateway weighs every draft with it.
        if draft.draft_token_cost is None:
            engine.draft_token_costs, measured = stored_or_measured_token_costs(
                engine, _pass_cost_key(config, runner), tuning_dir(config))
        else:
            engine.draft_token_costs, measured = {1: draft.draft_token_cost}, False
        log.info("draft_token_cost", cost_by_batch_size=engine.draft_token_costs,
                 source="set" if draft.draft_token_cost is not None else "measured" if measured else "stored")
        if draft.capture_dir:  # after the warm-up, whose prompt is no traffic
            engine.start_capture(HiddenStateCapture(draft.capture_dir, draft.capture_layers,
                                                    runner.model.config.get_text_config()))
        return engine

    def stop(self) -> None:
        """Ends the followers (called on the model thread when the engine stops)."""
        if self.tp is not None:
            self.tp.broadcast(None)
        for process in self.followers:
            try:
                process.wait(_FOLLOWER_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()



def _spawn(config: VerifierConfig, rank: int, port: int) -> subprocess.Popen:
    config_json = json.dumps({f.name: getattr(config, f.name) for f in settable_fields(VerifierConfig)})
    return subprocess.Popen([sys.executable, "-m", "verifier_service.workers", "--rank", str(rank),
                             "--port", str(port), "--config-json", config_json])


def follow(config: VerifierConfig, rank: int, port: int) -> None:
    """A follower rank: runs rank 0's messages until it broadcasts None."""
    set_threads(config.threads, config.tensor_parallel_size)
    exit_with_parent()
    tp = init_tensor_parallel(resolve_device(config.device), rank, config.tensor_parallel_size, port)
    runner = build_runner(config, resolve_device(config.device), tp)
    while (message := tp.receive()) is not None:
        runner.handle(message)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a follower rank of a tensor-parallel verifier")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config-json", required=True)
    args = parser.parse_args(argv)
    config = VerifierConfig(**json.loads(args.config_json))
    configure_logging(f"verifier-rank{args.rank}", config.log_level)
    transformers_logging.disable_progress_bar()
    follow(config, args.rank, args.port)


if __name__ == "__main__":
    main()
