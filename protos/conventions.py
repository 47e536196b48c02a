"""What the contracts mean beyond their message types (metadata keys, message limits, finish
reasons, chain drafts), in one place for every service and client. Imports only protobuf."""

from protos.common.v1 import common_pb2

# gRPC metadata every service reads: one request id in all services' logs, and the tenant.
REQUEST_ID_METADATA_KEY = "x-request-id"
TENANT_METADATA_KEY = "x-tenant-id"
# Long prompts travel as token ids; gRPC's 4 MiB default is too small for them.
MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
# A channel whose peer refused it waits before dialling again, 1 s growing to 120 s by default:
# a verifier restarted after a minute's outage would get no sequences for up to two more.
# Capped, a restarted peer is found within about 2 s (a dial to a live host is cheap).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


# Keepalive: a peer that vanished without closing (a host down, a NAT that dropped the
# flow) fails its streams within 40 s instead of hanging them, and an idle channel stays
# open through middleboxes. Each side pings after `ping_after_ms` without traffic, and a
# server accepts pings a third of that apart: gRPC's own floor is 5 minutes, past which
# it counts a ping as a strike and, at the third, closes the connection with GOAWAY
# (too_many_pings). GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is spelled
# "grpc.http2.min_ping_interval_without_data_ms"; gRPC ignores a key it does not know.
def channel_options(ping_after_ms: int = 30_000) -> tuple[tuple[str, int], ...]:
    """For every channel and server of ours (servers ignore the reconnect options)."""
    return (
        ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
        ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
        ("grpc.keepalive_time_ms", ping_after_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", ping_after_ms // 3),
        *RECONNECT_OPTIONS,
    )


CHANNEL_OPTIONS = channel_options()

# Continuations one verifier.v1.NextRound may offer: the step's own continuation and seven detours.
MAX_NEXT_ROUND_CONTINUATIONS = 8

# FinishReason values and the names the APIs report (OpenAI's `finish_reason`).
FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
FINISH_REASONS_BY_NAME = {name: value for value, name in FINISH_REASON_NAMES.items()}


def chain_parents(length: int) -> tuple[int, ...]:
    """A Draft's `parents` for a single path (each token follows the previous one);
    an empty `parents` field means the same."""
    return tuple(range(-1, length - 1))


def request_metadata(request_id: str, tenant: str = "") -> tuple[tuple[str, str], ...]:
    """Metadata that carries the request id (and the tenant, if any) to a downstream call."""
    if tenant:
        return ((REQUEST_ID_METADATA_KEY, request_id), (TENANT_METADATA_KEY, tenant))
    return ((REQUEST_ID_METADATA_KEY, request_id),)
