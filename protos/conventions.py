"""What the contracts mean beyond their message types (metadata keys, message limits, finish
reasons, chain drafts), in one place for every service and client. Imports only protobuf."""

from protos.common.v1 import common_pb2

# gRPC metadata every service reads: one request id in all services' logs, and the tenant.
REQUEST_ID_METADATA_KEY = "x-request-id"
TENANT_METADATA_KEY = "x-tenant-id"
# Long prompts travel as token ids; gRPC's 4 MiB default is too small for them.
MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
# Keepalive: a peer that vanished without closing (a host down, a NAT that dropped the
# flow) fails its streams within 40 s instead of hanging them, and an idle channel stays
# open through middleboxes. Each side pings after 30 s without traffic and accepts pings
# every 10 s, so neither answers the other's pings with GOAWAY (too_many_pings).
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
)
# A channel whose peer refused it waits before dialling again, 1 s growing to 120 s by default:
# a verifier restarted after a minute's outage would get no sequences for up to two more.
# Capped, a restarted peer is found within about 2 s (a dial to a live host is cheap).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)
# For every channel and server of ours (servers ignore the reconnect options).
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
    *KEEPALIVE_OPTIONS,
    *RECONNECT_OPTIONS,
)

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
