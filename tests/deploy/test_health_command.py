"""`speclane health grpc|http`, the probe every compose healthcheck runs: its exit code
is the verdict, so these run the real command in a subprocess against live servers."""

import asyncio
import http.server
import pathlib
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

pytestmark = pytest.mark.e2e  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def speclane_health(*args: str, block_heavy_imports: bool = False) -> subprocess.CompletedProcess:
    if block_heavy_imports:
        # torch and transformers raise ImportError: the probe must not need them (it runs in the light image
        # every few seconds; importing either would cost seconds and memory).
        code = ("import sys; sys.modules.update(torch=None, transformers=None); "
                "from speclane_cli.main import main; sys.exit(main(sys.argv[1:]))")
        argv = [sys.executable, "-c", code, "health", *args]
    else:
        argv = [sys.executable, "-m", "speclane_cli", "health", *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)


class GrpcHealthServer:
    """A grpc.aio server with only the health service, on its own event loop thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def set_status(self, status) -> None:
        self._call(self.servicer.set("", status))

    def stop(self) -> None:
        self._call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def grpc_server():
    server = GrpcHealthServer()
    yield server
    server.stop()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the http.server API
        self.send_response(200 if self.path == "/health" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):  # keep pytest's output clean
        pass


@pytest.fixture(scope="module")
def http_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_grpc_serving_exits_0(grpc_server):
    grpc_server.set_status(SERVING)
    result = speclane_health("grpc", f"127.0.0.1:{grpc_server.port}")
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout


def test_grpc_not_serving_exits_1(grpc_server):
    grpc_server.set_status(NOT_SERVING)
    try:
        result = speclane_health("grpc", f"127.0.0.1:{grpc_server.port}")
    finally:
        grpc_server.set_status(SERVING)
    assert result.returncode == 1
    assert "NOT_SERVING" in result.stderr


def test_grpc_closed_port_exits_1():
    result = speclane_health("grpc", f"127.0.0.1:{closed_port()}", "--timeout", "1")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_grpc_silent_peer_times_out():
    """A peer that accepts TCP but never speaks HTTP/2 (a hung process) fails within the timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        started = time.monotonic()
        result = speclane_health("grpc", f"127.0.0.1:{listener.getsockname()[1]}", "--timeout", "0.5")
    assert result.returncode == 1
    assert time.monotonic() - started < 30


def test_http_200_exits_0(http_url):
    result = speclane_health("http", f"{http_url}/health")
    assert result.returncode == 0, result.stderr
    assert "HTTP 200" in result.stdout


def test_http_503_exits_1(http_url):
    result = speclane_health("http", f"{http_url}/not-ready")
    assert result.returncode == 1
    assert "HTTP 503" in result.stderr


def test_http_closed_port_exits_1():
    result = speclane_health("http", f"http://127.0.0.1:{closed_port()}/health", "--timeout", "1")
    assert result.returncode == 1


def test_probe_imports_no_torch_or_transformers(grpc_server, http_url):
    grpc_server.set_status(SERVING)
    assert speclane_health("grpc", f"127.0.0.1:{grpc_server.port}", block_heavy_imports=True).returncode == 0
    assert speclane_health("http", f"{http_url}/health", block_heavy_imports=True).returncode == 0


def test_bad_usage_is_not_healthy():
    assert speclane_health("grpc").returncode != 0  # argparse: missing HOST:PORT
    assert speclane_health("http", "http://127.0.0.1:1/", "--timeout", "0").returncode == 2
