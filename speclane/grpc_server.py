"""gRPC server lifecycle shared by the services: health, reflection, message
limits, overload limit, TLS, warm-up before SERVING and a graceful drain on SIGTERM."""

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.conventions import CHANNEL_OPTIONS, REQUEST_ID_METADATA_KEY
from speclane.log import bind_request_id, metadata_value, new_request_id
from speclane.tls import TlsFiles

log = structlog.get_logger()


def run_service(main: Coroutine) -> None:
    """Runs a service's main coroutine on uvloop's event loop where it is installed (as vLLM's API server does):
    every step's gRPC messages and streamed HTTP chunks pass through the loop, and on it the gateway and the
    drafter spent about an eighth less CPU a step than on asyncio's (docs/benchmarks/vllm-cpu, run 17)."""
    try:
        import uvloop
    except ImportError:  # not built for this platform: asyncio's own loop
        asyncio.run(main)
        return
    uvloop.run(main)


def bind_request_id_from(context: grpc.aio.ServicerContext) -> str:
    """Binds the caller's request id (or a fresh one) to this task's log lines."""
    request_id = metadata_value(context.invocation_metadata(), REQUEST_ID_METADATA_KEY) or new_request_id()
    bind_request_id(request_id)
    return request_id


async def serve(
    *,
    address: str,
    add_servicers: Callable[[grpc.aio.Server], list[str]],
    warmup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    max_concurrent_rpcs: int | None = None,
    grace_seconds: float = 5.0,
    ready: Callable[[int], None] | None = None,
    tls: TlsFiles = TlsFiles(),
) -> None:
    """Runs a gRPC server until SIGTERM/SIGINT.

    `add_servicers` registers the service's servicers and returns their full
    names; health reports NOT_SERVING until `warmup` finished, and again while
    draining. `ready` receives the bound port (useful with port 0). With a
    certificate in `tls` it serves TLS, and with a CA too only mTLS clients.
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS, maximum_concurrent_rpcs=max_concurrent_rpcs)
    service_names = add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    credentials = tls.server_credentials()
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot bind gRPC address {address}")

    async def set_status(status) -> None:
        for name in ("", *service_names):
            await health_servicer.set(name, status)

    await set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    log.info("grpc_listening", address=address, port=port, tls=tls.server_mode)
    if ready is not None:
        ready(port)
    if warmup is not None:
        warm = asyncio.ensure_future(warmup())
        await asyncio.wait([warm, asyncio.ensure_future(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not warm.done():
            warm.cancel()
        elif warm.exception() is not None:
            await server.stop(0)
            raise warm.exception()
    if not stopping.is_set():
        await set_status(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", services=service_names)
        await stopping.wait()
    log.info("draining", grace_seconds=grace_seconds)
    await set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace_seconds)
    if on_shutdown is not None:
        await on_shutdown()
    log.info("stopped")
