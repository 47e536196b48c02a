"""`speclane health grpc HOST:PORT` / `speclane health http URL`: one probe, answered by the exit code.

Container healthchecks (compose) call this; it imports only grpcio, the standard
library, speclane.net and speclane.tls, so it costs no torch or transformers
start-up and works in the light image.
Exit 0: healthy (gRPC: the service "" reports SERVING; HTTP: status 200). Exit 1:
anything else, including a refused connection, a failed TLS handshake or a timeout.
Exit 2: bad usage (TLS files missing or mismatched)."""

import ssl
import sys

from speclane.net import probe_http

DEFAULT_TIMEOUT_SECONDS = 2.0


def add_arguments(parser) -> None:
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    grpc_parser = kinds.add_parser("grpc", help="grpc.health.v1 Check of the server's overall health (service \"\")")
    grpc_parser.add_argument("target", metavar="HOST:PORT", help="gRPC address, e.g. 127.0.0.1:50061")
    grpc_parser.add_argument("--tls-ca", default="",
                             help="PEM CA the server's certificate is signed by: probe over TLS")
    grpc_parser.add_argument("--tls-cert", default="",
                             help="PEM client certificate, for a server that requires one (mTLS); needs --tls-ca")
    grpc_parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    grpc_parser.add_argument("--tls-server-name", default="",
                             help="name the server's certificate must carry, instead of HOST")
    http_parser = kinds.add_parser("http", help="GET a URL; healthy only on HTTP 200")
    http_parser.add_argument("target", metavar="URL", help="e.g. http://127.0.0.1:8000/health")
    http_parser.add_argument("--tls-ca", default="",
                             help="PEM CA an https URL's certificate is signed by (default: the system's CAs)")
    for sub in (grpc_parser, http_parser):
        sub.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                         help=f"seconds before the probe counts as failed (default {DEFAULT_TIMEOUT_SECONDS:g})")


def check_grpc(target: str, timeout: float, tls) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from speclane.tls import channel

    # A probe talks to the service directly, never through an http_proxy set in the environment.
    with channel(target, tls, options=(("grpc.enable_http_proxy", 0),)) as probe:
        try:
            reply = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(service=""),
                                                            timeout=timeout)
        except grpc.RpcError as error:
            return False, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def _probe(args) -> tuple[bool, str]:
    """The probe `args` ask for; ValueError on bad TLS files."""
    if args.kind == "http":
        context = ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else None
        return probe_http(args.target, args.timeout, context)
    # grpc only here: an HTTP probe does without it.
    from speclane.tls import TlsFiles

    if args.tls_cert and not args.tls_ca:
        raise ValueError("--tls-cert needs --tls-ca: without a CA the probe is plaintext")
    return check_grpc(args.target, args.timeout, TlsFiles(args.tls_cert, args.tls_key, args.tls_ca,
                                                          args.tls_server_name))


def run(args) -> int:
    if args.timeout <= 0:
        print("speclane health: --timeout must be positive", file=sys.stderr)
        return 2
    try:
        healthy, detail = _probe(args)
    except (ValueError, OSError) as exc:  # the probe's own TLS files: ssl raises OSError on a bad --tls-ca
        print(f"speclane health: {exc}", file=sys.stderr)
        return 2
    print(f"{args.target}: {detail}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1
