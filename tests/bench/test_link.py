"""The delayed link (`speclane bench link`) between a client and an echo server."""

import asyncio
import contextlib
import time

from speclane.net import free_port
from speclane_cli.bench.link import serve_link

ONE_WAY_SECONDS = 0.1


async def echo(reader, writer):
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_every_byte_crosses_in_order_a_round_trip_later():
    async def main():
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        listen = f"127.0.0.1:{free_port()}"
        link = asyncio.ensure_future(serve_link(listen, target, ONE_WAY_SECONDS))
        try:
            for _ in range(100):  # until the link listens
                with contextlib.suppress(OSError):
                    reader, writer = await asyncio.open_connection(*listen.rsplit(":", 1))
                    break
                await asyncio.sleep(0.02)
            sent = time.monotonic()
            # Three chunks in flight at once: each is held, none waits for the one before.
            for chunk in (b"first ", b"second ", b"third"):
                writer.write(chunk)
                await writer.drain()
            echoed = await asyncio.wait_for(reader.readexactly(len(b"first second third")), 5)
            elapsed = time.monotonic() - sent
            assert echoed == b"first second third"
            assert 2 * ONE_WAY_SECONDS <= elapsed < 5 * ONE_WAY_SECONDS  # one after another: 6
            writer.close()
        finally:
            link.cancel()
            server.close()

    asyncio.run(main())
