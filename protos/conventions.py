"""What the contracts' messages mean beyond their types, in one place for every service and client."""

from protos.common.v1 import common_pb2

# FinishReason values and the names the APIs report (OpenAI's `finish_reason`).
FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
FINISH_REASONS_BY_NAME = {name: value for value, name in FINISH_REASON_NAMES.items()}


def chain_parents(length: int) -> tuple[int, ...]:
    """A Draft's `parents` for a single path (each token follows the previous one);
    an empty `parents` field means the same."""
    return tuple(range(-1, length - 1))
