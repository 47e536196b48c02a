"""`speclane serve`: drafter, verifier and gateway as three processes talking
gRPC over localhost, each restarted when it dies, stopped together."""

import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable

import structlog

from drafter_service.config import ENV_PREFIX as DRAFTER_ENV
from drafter_service.config import DrafterConfig
from gateway.config import ENV_PREFIX as GATEWAY_ENV
from gateway.config import GatewayConfig
from speclane import config as config_flags
from speclane.fetch import speclane_home
from speclane.log import configure_logging
from speclane.models import DEFAULT_MODEL, PACKAGED_MODELS, resolve_model, served_name
from speclane.net import free_port, http_ok
from speclane.speculation import DRAFTER_WIDE_KEYS
from speclane.tls import issued
from speclane_cli.supervisor import Child, die_with_parent, supervise
from verifier_service.config import ENV_PREFIX as VERIFIER_ENV
from verifier_service.config import VerifierConfig

log = structlog.get_logger()

# Each service's flags that `speclane serve` sets itself rather than passing through: the addresses
# (free localhost ports), the TLS files (from the gateway's flags of the same names, or --tls-dir),
# the verifier's --speculative-config and --speculation-debug (the gateway's: the verifier loads its
# head), and the drafter's tree shape (--speculative-config's drafter-wide keys).
SET_BY_SERVE = {
    "gateway": frozenset({"model", "grpc_address", "drafter_address", "verifier_addresses"}),
    "verifier": frozenset({"model", "model_name", "address", "log_level", "tls_cert", "tls_key", "tls_ca",
                           "speculative_config", "speculation_debug"}),
    "drafter": frozenset({"address", "log_level", "metrics_port", "tls_cert", "tls_key", "tls_ca",
                          *DRAFTER_WIDE_KEYS.values()}),
}
_TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca")


def add_arguments(parser) -> None:
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", help="as `vllm serve MODEL`: same as --model")
    parser.add_argument("--model", default=os.environ.get("SPECLANE_MODEL", DEFAULT_MODEL),
                        help="packaged model name, Hugging Face model directory, or hub model id org/name "
                             f"(env SPECLANE_MODEL; default {DEFAULT_MODEL!r})")
    config_flags.add_arguments(parser, GatewayConfig, GATEWAY_ENV, exclude=SET_BY_SERVE["gateway"])
    config_flags.add_arguments(parser, VerifierConfig, VERIFIER_ENV, exclude=SET_BY_SERVE["verifier"])
    config_flags.add_arguments(parser, DrafterConfig, DRAFTER_ENV, exclude=SET_BY_SERVE["drafter"])
    if DRAFTER_ENV + "SNAPSHOT_PATH" not in os.environ:
        # A drafter restarted by the supervisor (or the next `speclane serve`) starts warm; '' turns it off.
        parser.set_defaults(snapshot_path=None)
    if GATEWAY_ENV + "TOOL_CALL_PARSER" not in os.environ:
        parser.set_defaults(tool_call_parser=None)  # the packaged model's own, else hermes
    parser.add_argument("--grpc-port", type=int, default=50060, help="port of the public gRPC Generate API")
    parser.add_argument("--tls-dir", default="",
                        help="a directory made by `speclane certs`: mTLS between the services, each with its own "
                             "certificate, and TLS on the gRPC Generate API (instead of --tls-cert/--tls-key/--tls-ca)")


def run(args) -> int:
    try:
        configs = configs_from_args(args)
    except ValueError as exc:  # the configs validate themselves: this is the user's input
        print(f"speclane serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(*configs)


def configs_from_args(args):
    """Builds the three services' configs; internal services get free localhost ports."""
    model = args.model_positional or args.model
    drafter_address = f"127.0.0.1:{free_port()}"
    verifier_address = f"127.0.0.1:{free_port()}"
    model_name = args.served_model_name or served_name(model)
    model_dir = str(resolve_model(model))
    tls = _tls_flags(args)
    packaged = PACKAGED_MODELS.get(model)
    tool_call_parser = (args.tool_call_parser if args.tool_call_parser is not None
                        else packaged.tool_call_parser if packaged else "hermes")
    gateway = config_flags.from_namespace(
        GatewayConfig, args, model=model_dir, served_model_name=model_name, tool_call_parser=tool_call_parser,
        grpc_address=f"{args.host}:{args.grpc_port}", drafter_address=drafter_address,
        verifier_addresses=(verifier_address,), **tls["gateway"],
    )
    verifier = config_flags.from_namespace(
        VerifierConfig, args, model=model_dir, model_name=model_name, address=verifier_address,
        log_level=args.log_level, speculative_config=args.speculative_config,
        speculation_debug=args.speculation_debug, **tls["verifier"],
    )
    # The drafter-wide keys of --speculative-config configure the drafter itself.
    drafter_wide = {DRAFTER_WIDE_KEYS[key]: value for key, value in gateway.drafter_wide_speculation.items()}
    snapshot_path = default_snapshot_path(model_name) if args.snapshot_path is None else args.snapshot_path
    drafter = config_flags.from_namespace(DrafterConfig, args, exclude=SET_BY_SERVE["drafter"],
                                          address=drafter_address, log_level=args.log_level,
                                          snapshot_path=snapshot_path, **drafter_wide, **tls["drafter"])
    return drafter, verifier, gateway


def default_snapshot_path(model_name: str) -> str:
    """Where `speclane serve` keeps the drafter's global trees: one file per served model, since
    the trees hold the model's token ids."""
    return str(speclane_home() / "drafter" / (re.sub(r"[^A-Za-z0-9._-]", "_", model_name) + ".snapshot"))


def _tls_flags(args) -> dict[str, dict[str, str]]:
    """Each service's TLS files: its own from --tls-dir, or --tls-cert/--tls-key/--tls-ca for
    all three. The drafter and verifier serve TLS only with a CA: without one the gateway
    dials them in plaintext, and its certificate serves only the gRPC Generate API."""
    given = {flag: getattr(args, flag) for flag in _TLS_FLAGS}
    if args.tls_dir:
        if any(given.values()):
            raise ValueError("--tls-dir and --tls-cert/--tls-key/--tls-ca exclude each other")
        own = {service: issued(args.tls_dir, service) for service in ("drafter", "verifier", "gateway")}
        return {service: {"tls_cert": files.cert, "tls_key": files.key, "tls_ca": files.ca}
                for service, files in own.items()}
    backend = given if given["tls_ca"] else dict.fromkeys(_TLS_FLAGS, "")
    return {"drafter": backend, "verifier": backend, "gateway": given}


def _spawn(module: str, config, env_prefix: str) -> Callable[[], subprocess.Popen]:
    # Own session: Ctrl-C reaches only the supervisor, which stops the services in order.
    env = {**os.environ, **config_flags.to_env(config, env_prefix)}
    return lambda: subprocess.Popen([sys.executable, "-m", module, *config_flags.to_argv(config)], env=env,
                                    start_new_session=True, preexec_fn=die_with_parent)


def serve(drafter, verifier, gateway) -> int:
    """Runs the three services until Ctrl-C/SIGTERM, restarting any that dies; returns the exit code.

    A dead drafter only slows generation down; while the verifier is away the
    gateway answers 503; a dead gateway drops its connections. Each comes back.
    """
    configure_logging("serve", gateway.log_level)
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    # Started in this order and stopped in reverse: the gateway first, so no
    # request reaches a service that is already gone.
    children = [Child("drafter", _spawn("drafter_service", drafter, DRAFTER_ENV)),
                Child("verifier", _spawn("verifier_service", verifier, VERIFIER_ENV)),
                Child("gateway", _spawn("gateway", gateway, GATEWAY_ENV))]
    announced = False
    scheme = "https" if gateway.ssl_certfile else "http"
    # Whether our own child answers, not who it is: its certificate need not name this address.
    unverified = ssl.create_default_context()
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE

    def announce_once() -> None:
        nonlocal announced
        if not announced and http_ok(f"{scheme}://{gateway.host}:{gateway.port}/health", context=unverified):
            announced = True
            log.info("ready", url=f"{scheme}://{gateway.host}:{gateway.port}/v1", model=gateway.served_model_name)

    return supervise(children, lambda: stopping, on_tick=announce_once)
