"""Verifier process: load the model on the model thread, then serve gRPC."""

from collections.abc import Callable

from transformers.utils import logging as transformers_logging

from speclane.grpc_server import serve
from speclane.log import configure_logging
from verifier_service.config import VerifierConfig
from verifier_service.device import resolve_device, resolve_dtype, set_threads
from verifier_service.engine import AsyncEngine
from verifier_service.model_runner import ModelRunner
from verifier_service.service import VerifierServicer, add_to_server


async def run(config: VerifierConfig, *, ready: Callable[[int], None] | None = None) -> None:
    """Serves until SIGTERM; health is NOT_SERVING until the model is loaded and warm."""
    configure_logging("verifier", config.log_level)
    # Progress bars would break the one-JSON-object-per-line log stream.
    transformers_logging.disable_progress_bar()
    # Before any torch op: threads started later (the model thread) inherit it.
    set_threads(config.threads)

    def load_runner() -> ModelRunner:
        device = resolve_device(config.device)
        return ModelRunner(config.model, device, resolve_dtype(config.dtype, device))

    engine = AsyncEngine(load_runner, threads=config.threads)
    servicer = VerifierServicer(engine, config.model_name)

    async def shutdown() -> None:
        engine.shutdown()

    await serve(
        address=config.address,
        add_servicers=lambda server: add_to_server(server, servicer),
        warmup=engine.start,
        on_shutdown=shutdown,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
        ready=ready,
    )
