"""The services' event loop: uvloop's where it is installed, asyncio's where it is not."""

import asyncio
import sys

import uvloop

from speclane.grpc_server import run_service


def loop_type() -> list[type]:
    seen = []

    async def main():
        seen.append(type(asyncio.get_running_loop()))

    run_service(main())
    return seen


def test_a_service_runs_on_uvloop_where_it_is_installed():
    assert loop_type() == [uvloop.Loop]


def test_a_service_runs_on_asyncio_without_uvloop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as where it cannot be installed: the import fails
    (seen,) = loop_type()
    assert not issubclass(seen, uvloop.Loop) and issubclass(seen, asyncio.AbstractEventLoop)
