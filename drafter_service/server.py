"""Runs the drafter gRPC server until SIGTERM."""

from collections.abc import Callable

import grpc
import structlog

from drafter_service.config import DrafterConfig
from drafter_service.service import SERVICE_NAME, DrafterServicer
from drafter_service.suffix_decoding import SuffixDecodingCache
from protos.drafter.v1 import drafter_pb2_grpc
from speclane.grpc_server import serve
from speclane.log import configure_logging

log = structlog.get_logger()


async def run(config: DrafterConfig, ready: Callable[[int], None] | None = None) -> None:
    """Serves Drafter.Session; `ready` receives the bound port (handy with port 0)."""
    configure_logging("drafter", config.log_level)
    cache = SuffixDecodingCache(config.max_tree_depth, config.max_cached_requests)

    def add_servicers(server: grpc.aio.Server) -> list[str]:
        drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(cache, config.max_tree_depth), server)
        return [SERVICE_NAME]

    async def on_shutdown() -> None:
        log.info("drafter_stopped", cached_requests=len(cache.cached_requests))

    log.info("drafter_starting", max_tree_depth=config.max_tree_depth,
             max_cached_requests=config.max_cached_requests)
    await serve(address=config.address, add_servicers=add_servicers, on_shutdown=on_shutdown,
                max_concurrent_rpcs=config.max_concurrent_rpcs, ready=ready)
