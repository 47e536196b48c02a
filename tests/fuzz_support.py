"""What the fuzz tests share: how many examples they run, and an event loop of
their own for the servers they fuzz, which the (synchronous) hypothesis tests call into.

`make test` runs each fuzz test with a small, fixed set of examples (derandomized: the
same inputs every run). `make fuzz` sets SPECLANE_FUZZ_EXAMPLES: every fuzz test then
runs that many examples, new ones on every run."""

import contextlib
import os
import time

import anyio.from_thread
from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("SPECLANE_FUZZ_EXAMPLES", "0")) or None


def fuzz_settings(default_examples: int) -> settings:
    return settings(max_examples=EXAMPLES or default_examples, deadline=None, database=None,
                    derandomize=EXAMPLES is None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


@contextlib.contextmanager
def serving(async_context_manager_factory):
    """Runs an async context manager (the servers under test) on a loop in a thread of
    its own; yields (portal, what it yields). portal.call(fn, *args) runs fn there."""
    with anyio.from_thread.start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(async_context_manager_factory()) as value:
        yield portal, value


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Polls `predicate` from the test's thread until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.01)
