"""Verifier process: load the model on the model thread (with its follower
ranks under tensor parallelism), then serve gRPC."""

import dataclasses
import os
import random
from collections.abc import Callable

import structlog
import torch
from transformers.utils import logging as transformers_logging

from speclane.allocator import allocator
from speclane.config import parse_config
from speclane.grpc_server import run_service, serve
from speclane.log import configure_logging
from speclane.models import resolve_model
from verifier_service.async_engine import AsyncEngine
from verifier_service.config import ENV_PREFIX, VerifierConfig
from verifier_service.device import resolve_threads, set_threads
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import VerifierServicer, add_to_server
from verifier_service.workers import Rank0

log = structlog.get_logger()


def seed_everything(seed: int) -> None:
    """vLLM's --seed: Python's generator and torch's (on every device)."""
    random.seed(seed)
    torch.manual_seed(seed)


async def run(config: VerifierConfig, *, ready: Callable[[int], None] | None = None) -> None:
    """Serves until SIGTERM; health is NOT_SERVING until the model is loaded and warm."""
    configure_logging("verifier", config.log_level)
    log.info("verifier_starting", malloc=allocator(os.environ))
    # Progress bars would break the one-JSON-object-per-line log stream.
    transformers_logging.disable_progress_bar()
    # A packaged model name or a hub model id becomes its directory (fetched once if missing).
    config = dataclasses.replace(config, model=str(resolve_model(config.model)))
    # Before any torch op: threads started later (the model thread) inherit it.
    set_threads(config.threads, config.tensor_parallel_size)
    seed_everything(config.seed)
    metrics = VerifierMetrics(config.model_name)
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.address.rsplit(":", 1)[0])
    rank0 = Rank0(config, on_step=metrics.observe)
    engine = AsyncEngine(rank0.load, threads=resolve_threads(config.threads, config.tensor_parallel_size),
                         on_stop=rank0.stop, batch_wait_seconds=config.batch_wait_ms / 1000)
    servicer = VerifierServicer(engine, config.model_name, config.model, config.max_draft_tokens)

    async def shutdown() -> None:
        await engine.stop()

    await serve(
        address=config.address,
        add_servicers=lambda server: add_to_server(server, servicer),
        warmup=engine.start,
        on_shutdown=shutdown,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
        ready=ready,
        tls=config.tls,
    )


def main(argv: list[str] | None = None, prog: str = "python -m verifier_service") -> None:
    config = parse_config(VerifierConfig, ENV_PREFIX, argv, prog, "the verifier service")
    try:
        run_service(run(config))
    except ValueError as refused:  # a model or memory it cannot serve: one line, no traceback
        raise SystemExit(f"verifier: refused to start: {refused}") from None
