"""`speclane serve`: drafter, verifier and gateway as three processes talking
gRPC over localhost, supervised together and stopped together."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import structlog

from drafter_service.config import DrafterConfig
from gateway.config import ENV_PREFIX as GATEWAY_ENV
from gateway.config import GatewayConfig
from speclane import config as config_flags
from speclane.log import configure_logging
from speclane.models import DEFAULT_MODEL, resolve_model
from speclane.net import free_port
from speclane.speculation import DRAFTER_WIDE_KEYS
from verifier_service.config import ENV_PREFIX as VERIFIER_ENV
from verifier_service.config import VerifierConfig

log = structlog.get_logger()

# Verifier flags `speclane serve` passes through; the rest it sets itself.
_VERIFIER_OWN_FLAGS = frozenset({"model", "model_name", "address", "log_level"})
_STOP_TIMEOUT_SECONDS = 20.0
_DRAFTER_RESTART_DELAY_SECONDS = 1.0


def add_arguments(parser) -> None:
    config_flags.add_arguments(parser, GatewayConfig, GATEWAY_ENV,
                               exclude=frozenset({"grpc_address", "drafter_address", "verifier_addresses"}))
    config_flags.add_arguments(parser, VerifierConfig, VERIFIER_ENV, exclude=_VERIFIER_OWN_FLAGS)
    parser.add_argument("--grpc-port", type=int, default=50060, help="port of the public gRPC Generate API")


def run(args) -> int:
    try:
        configs = configs_from_args(args)
    except ValueError as exc:  # the configs validate themselves: this is the user's input
        print(f"speclane serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(*configs)


def configs_from_args(args):
    """Builds the three services' configs; internal services get free localhost ports."""
    drafter_address = f"127.0.0.1:{free_port()}"
    verifier_address = f"127.0.0.1:{free_port()}"
    model_name = args.served_model_name or (args.model if args.model == DEFAULT_MODEL else os.path.basename(
        os.path.normpath(args.model)))
    model_dir = str(resolve_model(args.model))
    gateway = config_flags.from_namespace(
        GatewayConfig, args, model=model_dir, served_model_name=model_name,
        grpc_address=f"{args.host}:{args.grpc_port}", drafter_address=drafter_address,
        verifier_addresses=(verifier_address,),
    )
    verifier = config_flags.from_namespace(
        VerifierConfig, args, model=model_dir, model_name=model_name, address=verifier_address,
        log_level=args.log_level,
    )
    # The drafter-wide keys of --speculative-config configure the drafter itself.
    drafter_wide = {DRAFTER_WIDE_KEYS[key]: value for key, value in gateway.drafter_wide_speculation.items()}
    drafter = DrafterConfig(address=drafter_address, log_level=args.log_level, **drafter_wide)
    return drafter, verifier, gateway


def _spawn(module: str, config) -> subprocess.Popen:
    # Own session: Ctrl-C reaches only the supervisor, which stops the services in order.
    return subprocess.Popen([sys.executable, "-m", module, *config_flags.to_argv(config)], start_new_session=True)


def _http_ready(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _stop(processes: dict[str, subprocess.Popen]) -> None:
    # The gateway first, so no request reaches a service that is already gone.
    for name in ("gateway", "verifier", "drafter"):
        process = processes[name]
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(_STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning("service_killed", service=name)
                process.kill()
                process.wait()


def serve(drafter, verifier, gateway) -> int:
    """Runs until Ctrl-C/SIGTERM or until the verifier or gateway dies; returns the exit code."""
    configure_logging("serve", gateway.log_level)
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    modules = {"drafter": ("drafter_service", drafter), "verifier": ("verifier_service", verifier),
               "gateway": ("gateway", gateway)}
    processes = {name: _spawn(module, cfg) for name, (module, cfg) in modules.items()}
    announced = False
    exit_code = 0
    try:
        while not stopping:
            time.sleep(0.5)
            if processes["drafter"].poll() is not None:
                # A dead drafter only slows generation down; bring it back.
                log.warning("drafter_exited", returncode=processes["drafter"].returncode)
                time.sleep(_DRAFTER_RESTART_DELAY_SECONDS)
                processes["drafter"] = _spawn(*modules["drafter"])
            failed = [n for n in ("verifier", "gateway") if processes[n].poll() is not None]
            if failed:
                log.error("service_exited", services=failed)
                exit_code = 1
                break
            if not announced and _http_ready(gateway.host, gateway.port):
                announced = True
                log.info("ready", url=f"http://{gateway.host}:{gateway.port}/v1",
                         model=gateway.served_model_name)
    finally:
        _stop(processes)
    return exit_code
