"""Starts the three real services as separate processes on free localhost ports."""

import contextlib
import dataclasses
import os
import pathlib
import signal
import ssl
import subprocess
import sys
import time
import urllib.request

from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from speclane.config import to_argv
from speclane.net import free_port, http_ok, wait_http_ok
from speclane.tls import TlsFiles, channel, issued
from speclane_cli.supervisor import die_with_parent, terminate
from verifier_service.config import VerifierConfig

_START_TIMEOUT_SECONDS = 180



def grpc_health(address: str, tls: TlsFiles = TlsFiles()) -> int:
    with channel(address, tls) as probe:
        reply = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


def tls_fields(tls_dir: pathlib.Path | None, service: str) -> dict[str, str]:
    """`service`'s TLS flags from a directory made by `speclane certs` (none without one)."""
    if tls_dir is None:
        return {}
    files = issued(str(tls_dir), service)
    return {"tls_cert": files.cert, "tls_key": files.key, "tls_ca": files.ca}


@dataclasses.dataclass
class Stack:
    drafter: DrafterConfig
    verifier: VerifierConfig
    gateway: GatewayConfig
    log_dir: pathlib.Path
    processes: dict = dataclasses.field(default_factory=dict)
    more_verifiers: tuple[VerifierConfig, ...] = ()  # started as verifier-2, verifier-3...
    more_gateways: tuple[GatewayConfig, ...] = ()  # started as gateway-2, gateway-3...

    @property
    def verifier_names(self) -> list[str]:
        return ["verifier", *(f"verifier-{i}" for i in range(2, 2 + len(self.more_verifiers)))]

    @property
    def gateway_names(self) -> list[str]:
        return ["gateway", *(f"gateway-{i}" for i in range(2, 2 + len(self.more_gateways)))]

    @property
    def base_url(self) -> str:
        scheme = "https" if self.gateway.ssl_certfile else "http"
        return f"{scheme}://{self.gateway.host}:{self.gateway.port}/v1"

    @property
    def http_context(self) -> ssl.SSLContext | None:
        """Verifies the gateway's HTTPS certificate: signed by the CA of the stack's TLS files."""
        return ssl.create_default_context(cafile=self.gateway.tls_ca) if self.gateway.ssl_certfile else None

    def start_service(self, name: str) -> None:
        verifiers = dict(zip(self.verifier_names, (self.verifier, *self.more_verifiers)))
        gateways = dict(zip(self.gateway_names, (self.gateway, *self.more_gateways)))
        module, config = (("verifier_service", verifiers[name]) if name in verifiers else
                          ("gateway", gateways[name]) if name in gateways else ("drafter_service", self.drafter))
        log_file = (self.log_dir / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", module, *to_argv(config)], stdout=log_file, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=die_with_parent,  # gone with an interrupted run
        )

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.logs(name)}")
            if all(http_ok(f"http://{gateway.host}:{gateway.port}/health") for gateway in self.more_gateways) and \
                    http_ok(self.base_url.removesuffix("/v1") + "/health", context=self.http_context) and \
                    self._gateway_sees_every_verifier():
                return
            time.sleep(0.5)
        raise TimeoutError("the stack did not become ready:\n" + "\n".join(self.logs(n) for n in self.processes))

    def _gateway_sees_every_verifier(self) -> bool:
        """/health needs one verifier; a test that expects the gateway to pick
        between several needs the gateway to have found them all serving."""
        if not self.more_verifiers or self.more_gateways:
            return True
        url = self.base_url.removesuffix("/v1") + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2, context=self.http_context) as reply:
                text = reply.read().decode()
        except OSError:
            return False
        count = 1 + len(self.more_verifiers)
        return f'speclane:verifiers_serving{{model_name="{self.gateway.served_model_name}"}} {count}.0' in text

    def logs(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for name in (*self.gateway_names, *self.verifier_names, "drafter"):
            process = self.processes.get(name)
            if process is not None:
                terminate(process, 30)


# The suite runs several stacks and itself on a small host: a verifier that took every core would
# oversubscribe them (a pass then takes 10-40x longer), so each takes one.
TEST_THREADS = 1


def start_stack(model_dir: pathlib.Path, log_dir: pathlib.Path, speculative_config: str = "",
                tls_dir: pathlib.Path | None = None, num_verifiers: int = 1, dtype: str = "auto",
                speculation_debug: str = "", gateway_per_verifier: bool = False,
                verifier_options: dict | None = None) -> Stack:
    """With `tls_dir` (made by `speclane certs`): mTLS between the services, TLS on the
    gateway's gRPC port and HTTPS, each service with its own certificate. `speculation_debug`
    (--speculation-debug) goes to the verifier and the gateway alike. With `gateway_per_verifier`
    each verifier gets a gateway of its own, all sharing the drafter (a router then picks the gateway).
    `verifier_options`: more VerifierConfig fields for every verifier."""
    drafter = DrafterConfig(address=f"127.0.0.1:{free_port()}", **tls_fields(tls_dir, "drafter"))
    # As `speclane serve`: the verifier loads the head a head method names.
    verifier, *more_verifiers = (
        VerifierConfig(model=str(model_dir), model_name="smollm2-135m-instruct", address=f"127.0.0.1:{free_port()}",
                       speculative_config=speculative_config, speculation_debug=speculation_debug, dtype=dtype,
                       threads=TEST_THREADS, **(verifier_options or {}),
                       **tls_fields(tls_dir, "verifier"))
        for _ in range(num_verifiers))
    gateway_tls = tls_fields(tls_dir, "gateway")
    https = {"ssl_certfile": gateway_tls["tls_cert"], "ssl_keyfile": gateway_tls["tls_key"]} if tls_dir else {}
    gateway = GatewayConfig(
        model=str(model_dir), served_model_name="smollm2-135m-instruct", port=free_port(),
        grpc_address=f"127.0.0.1:{free_port()}", drafter_address=drafter.address,
        verifier_addresses=tuple(v.address for v in (verifier, *more_verifiers)),
        speculative_config=speculative_config, speculation_debug=speculation_debug, **gateway_tls, **https,
    )
    more_gateways = ()
    if gateway_per_verifier:
        gateway = dataclasses.replace(gateway, verifier_addresses=(verifier.address,))
        more_gateways = tuple(dataclasses.replace(gateway, port=free_port(), grpc_address=f"127.0.0.1:{free_port()}",
                                                  verifier_addresses=(more.address,)) for more in more_verifiers)
    stack = Stack(drafter, verifier, gateway, log_dir, more_verifiers=tuple(more_verifiers),
                  more_gateways=more_gateways)
    for name in ("drafter", *stack.verifier_names, *stack.gateway_names):
        stack.start_service(name)
    try:
        stack.wait_ready()
    except BaseException:
        stack.stop()
        raise
    return stack


@contextlib.contextmanager
def speclane_serve(args: list[str], log_path: pathlib.Path):
    """Runs `speclane serve ARGS` on free ports until it is healthy; yields (process, HTTP port);
    stops it with SIGTERM and requires a clean exit."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "speclane_cli", "serve", "--port", str(port), "--grpc-port", str(free_port()),
         "--log-level", "warning", "--threads", str(TEST_THREADS),
         # Not the default under $SPECLANE_HOME: one run's trees would warm the next run's drafter.
         "--snapshot-path", str(log_path.parent / "drafter.snapshot"), *args],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=die_with_parent)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", process, timeout=240)
        yield process, port
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(60) == 0, log_path.read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
