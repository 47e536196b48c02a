"""Domain errors the servicer maps to gRPC status codes."""


class InvalidRequest(ValueError):
    """A malformed request (INVALID_ARGUMENT)."""


class SequenceFinished(RuntimeError):
    """A verify after the sequence finished (FAILED_PRECONDITION)."""


class StaleDraft(RuntimeError):
    """A draft tagged with a different sequence length (FAILED_PRECONDITION)."""


class ResourceExhausted(RuntimeError):
    """The KV budget cannot take the sequence, now or within the wait limit (RESOURCE_EXHAUSTED)."""
