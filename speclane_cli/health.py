"""`speclane health grpc HOST:PORT` / `speclane health http URL`: one probe, answered by the exit code.

Container healthchecks (compose) call this; it imports only grpcio, the standard
library and speclane.net, so it costs no torch or transformers start-up and works
in the light image.
Exit 0: healthy (gRPC: the service "" reports SERVING; HTTP: status 200). Exit 1:
anything else, including a refused connection or a timeout."""

import sys

from speclane.net import probe_http

DEFAULT_TIMEOUT_SECONDS = 2.0


def add_arguments(parser) -> None:
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    grpc_parser = kinds.add_parser("grpc", help="grpc.health.v1 Check of the server's overall health (service \"\")")
    grpc_parser.add_argument("target", metavar="HOST:PORT", help="gRPC address, e.g. 127.0.0.1:50061")
    http_parser = kinds.add_parser("http", help="GET a URL; healthy only on HTTP 200")
    http_parser.add_argument("target", metavar="URL", help="e.g. http://127.0.0.1:8000/health")
    for sub in (grpc_parser, http_parser):
        sub.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                         help=f"seconds before the probe counts as failed (default {DEFAULT_TIMEOUT_SECONDS:g})")


def check_grpc(target: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # A probe talks to the service directly, never through an http_proxy set in the environment.
    with grpc.insecure_channel(target, options=(("grpc.enable_http_proxy", 0),)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout)
        except grpc.RpcError as error:
            return False, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def run(args) -> int:
    if args.timeout <= 0:
        print("speclane health: --timeout must be positive", file=sys.stderr)
        return 2
    check = check_grpc if args.kind == "grpc" else probe_http
    healthy, detail = check(args.target, args.timeout)
    print(f"{args.target}: {detail}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1
