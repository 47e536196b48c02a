"""What one client may take of the gateway: generations at once (in all, and
per API key), and the size of an HTTP request body."""

import contextlib

from gateway.auth import ApiKey
from gateway.errors import Overloaded

# Far above any real prompt (128k tokens are about 1 MiB of JSON), far below memory trouble.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


class ConcurrencyLimiter:
    """Admits up to `limit` generations at once, and up to its own limit per API
    key, and refuses the rest at once (no queue: the client retries, and a queue
    would hide overload)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self._per_key: dict[str, int] = {}  # key_id -> generations in flight

    @contextlib.contextmanager
    def acquire(self, count: int = 1, caller: ApiKey | None = None):
        # A single event loop runs all requests, so check-and-add is atomic.
        key_limit = caller.max_concurrent_requests if caller is not None else None
        held = self._per_key.get(caller.key_id, 0) if caller is not None else 0
        # The key's own limit first: a client over it is told so, whatever the server's load.
        if key_limit is not None and held + count > key_limit:
            raise Overloaded(f"this API key is at its limit of {key_limit} concurrent generations; retry later")
        if self.in_flight + count > self.limit:
            raise Overloaded(f"server is at its limit of {self.limit} concurrent generations; retry later")
        self.in_flight += count
        if caller is not None:
            self._per_key[caller.key_id] = held + count
        try:
            yield
        finally:
            self.in_flight -= count
            if caller is not None:
                left = self._per_key.pop(caller.key_id) - count
                if left:
                    self._per_key[caller.key_id] = left
