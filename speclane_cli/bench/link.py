"""`speclane bench link`: a TCP link with a fixed delay each way, standing in
for the network between two hosts where `tc netem` is not offered (a container
without the sch_netem module). Put it between the gateway and a verifier
(`--verifier-addresses` pointing at `--listen`) to measure what the hop costs.

Every chunk is held `--one-way-delay-ms` and then forwarded, in order, in each
direction; chunks in flight do not wait for each other, as on a real link."""

import asyncio
import contextlib
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--listen", required=True, help="host:port to accept connections on")
    parser.add_argument("--target", required=True, help="host:port each connection is forwarded to")
    parser.add_argument("--one-way-delay-ms", type=float, default=2.5,
                        help="delay added in each direction (2.5: a 5 ms round trip)")


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copies reader to writer, each chunk `delay` seconds after it arrived."""
    loop = asyncio.get_running_loop()
    in_flight: asyncio.Queue = asyncio.Queue()

    async def deliver():
        while (item := await in_flight.get()) is not None:
            due, data = item
            await asyncio.sleep(due - loop.time())
            writer.write(data)
            await writer.drain()

    delivering = asyncio.ensure_future(deliver())
    try:
        while data := await reader.read(65536):
            in_flight.put_nowait((loop.time() + delay, data))
        in_flight.put_nowait(None)
        await delivering
    finally:
        delivering.cancel()
        with contextlib.suppress(OSError):
            writer.close()


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


async def serve_link(listen: str, target: str, one_way_delay_seconds: float) -> None:
    target_host, target_port = _host_port(target)

    async def connect(client_reader, client_writer):
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_writer.close()
            return
        with contextlib.suppress(OSError):
            await asyncio.gather(_forward(client_reader, upstream_writer, one_way_delay_seconds),
                                 _forward(upstream_reader, client_writer, one_way_delay_seconds))

    server = await asyncio.start_server(connect, *_host_port(listen))
    print(f"link {listen} -> {target}, {one_way_delay_seconds * 1000:g} ms each way", file=sys.stderr, flush=True)
    async with server:
        await server.serve_forever()


def run(args) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_link(args.listen, args.target, args.one_way_delay_ms / 1000))
    return 0
