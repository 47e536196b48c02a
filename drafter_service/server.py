"""Runs the drafter gRPC server until SIGTERM, restoring and saving snapshots of the global trees."""

import asyncio
import contextlib
import gc
import os
import pathlib
from collections.abc import Callable

import grpc
import structlog

from drafter_service import snapshot
from drafter_service.config import ENV_PREFIX, DrafterConfig
from drafter_service.engine import DraftEngine
from drafter_service.metrics import DrafterMetrics
from drafter_service.service import SERVICE_NAME, DrafterServicer
from protos.drafter.v1 import drafter_pb2_grpc
from speclane.allocator import allocator, reexecute_with_tcmalloc
from speclane.config import parse_config
from speclane.grpc_server import run_service, serve
from speclane.log import configure_logging

log = structlog.get_logger()


async def _save(engine: DraftEngine, path: pathlib.Path) -> None:
    try:
        # The core snapshots under its own lock without the GIL: sessions go on meanwhile.
        size = await asyncio.to_thread(snapshot.save, engine, path)
        log.info("snapshot_saved", path=str(path), bytes=size)
    except OSError as exc:
        log.error("snapshot_save_failed", path=str(path), error=str(exc))


async def _save_periodically(engine: DraftEngine, path: pathlib.Path, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await _save(engine, path)


async def run(config: DrafterConfig, ready: Callable[[int], None] | None = None) -> None:
    """Serves Drafter.Session; `ready` receives the bound port (handy with port 0)."""
    configure_logging("drafter", config.log_level)
    engine = DraftEngine(config.max_tree_depth, config.max_cached_requests, config.max_cached_tokens,
                         config.share_tenants)
    path = pathlib.Path(config.snapshot_path) if config.snapshot_path else None
    metrics = DrafterMetrics(engine.core)
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.address.rsplit(":", 1)[0])
    tasks: list[asyncio.Task] = []

    def add_servicers(server: grpc.aio.Server) -> list[str]:
        drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(engine, config, metrics), server)
        return [SERVICE_NAME]

    async def warmup() -> None:
        # Health says NOT_SERVING until the snapshot is loaded.
        if path is not None:
            await asyncio.to_thread(snapshot.load, engine, path)
            tasks.append(asyncio.create_task(_save_periodically(engine, path, config.snapshot_interval_seconds)))
        # What start-up made lives as long as the process: out of the collector's sight, a full collection
        # took 15 ms (every step waiting behind it) and now takes a fraction (as vLLM freezes after start-up).
        gc.freeze()

    async def on_shutdown() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if path is not None:
            await _save(engine, path)
        log.info("drafter_stopped", cached_requests=len(engine.core.cached_requests()),
                 memory_bytes=engine.core.memory_bytes())

    log.info("drafter_starting", malloc=allocator(os.environ), max_tree_depth=config.max_tree_depth,
             max_cached_requests=config.max_cached_requests, max_cached_tokens=config.max_cached_tokens,
             max_sessions=config.max_sessions, max_session_tokens=config.max_session_tokens,
             snapshot_path=config.snapshot_path or None)
    await serve(address=config.address, add_servicers=add_servicers, warmup=warmup, on_shutdown=on_shutdown,
                ready=ready, tls=config.tls)


def main(argv: list[str] | None = None, prog: str = "python -m drafter_service") -> None:
    reexecute_with_tcmalloc()
    run_service(run(parse_config(DrafterConfig, ENV_PREFIX, argv, prog, "the drafter service")))
