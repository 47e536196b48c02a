"""Errors meant for the client, raised anywhere in the gateway; each front end
maps them to its status codes (HTTP 400/404/429/503, gRPC INVALID_ARGUMENT/
NOT_FOUND/RESOURCE_EXHAUSTED/UNAVAILABLE)."""


class InvalidRequest(ValueError):
    """Bad input from the client: HTTP 400 / INVALID_ARGUMENT."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFound(InvalidRequest):
    """The request names something that does not exist (a stored response): HTTP 404 / NOT_FOUND."""


class ModelNotFound(NotFound):
    """The request names a model we do not serve: HTTP 404 / NOT_FOUND."""


class Overloaded(Exception):
    """Too many generations in flight: HTTP 429 / RESOURCE_EXHAUSTED."""


class Unavailable(Exception):
    """No verifier can take the request now (dead, restarting, loading): HTTP 503 / UNAVAILABLE."""
