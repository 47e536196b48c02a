"""`speclane bench link`: a TCP link with a fixed delay each way, standing in
for the network between two hosts where `tc netem` is not offered (a container
without the sch_netem module). Put it between the gateway and a verifier
(`--verifier-addresses` pointing at `--listen`) to measure what the hop costs.

Every chunk is held `--one-way-delay-ms` and then forwarded, in order, in each
direction; chunks in flight do not wait for each other, as on a real link.
Threads on blocking sockets rather than an event loop: an event loop's timers
wake on whole milliseconds (epoll's timeout), which held each 2.5 ms chunk
about 3.2 ms (6.4 ms round trips for 5 configured); `time.sleep` wakes within
tens of microseconds."""

import contextlib
import queue
import socket
import sys
import threading
import time


def add_arguments(parser) -> None:
    parser.add_argument("--listen", required=True, help="host:port to accept connections on")
    parser.add_argument("--target", required=True, help="host:port each connection is forwarded to")
    parser.add_argument("--one-way-delay-ms", type=float, default=2.5,
                        help="delay added in each direction (2.5: a 5 ms round trip)")


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _forward(source: socket.socket, sink: socket.socket, delay: float) -> None:
    """Copies source to sink, each chunk `delay` seconds after it arrived; then
    ends sink's sending side, so the far end sees the close a delay later too."""
    held: queue.SimpleQueue = queue.SimpleQueue()

    def deliver():
        with contextlib.suppress(OSError):
            while (item := held.get()) is not None:
                due, data = item
                time.sleep(max(0.0, due - time.monotonic()))
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)

    delivering = threading.Thread(target=deliver, daemon=True)
    delivering.start()
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            held.put((time.monotonic() + delay, data))
    held.put(None)
    delivering.join()


def _relay(client: socket.socket, target: tuple[str, int], delay: float) -> None:
    with client, contextlib.suppress(OSError), socket.create_connection(target) as upstream:
        for end in (client, upstream):  # a chunk goes out when it is due, not when more arrives
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_forward, args=(upstream, client, delay), daemon=True)
        back.start()
        _forward(client, upstream, delay)
        back.join()


class Link:
    """Listens on `listen` from construction; serve_forever() relays each
    connection to `target` until close()."""

    def __init__(self, listen: str, target: str, one_way_delay_seconds: float):
        self._server = socket.create_server(_host_port(listen))
        self._target = _host_port(target)
        self._delay = one_way_delay_seconds

    def serve_forever(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                client, _ = self._server.accept()
                threading.Thread(target=_relay, args=(client, self._target, self._delay), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def run(args) -> int:
    link = Link(args.listen, args.target, args.one_way_delay_ms / 1000)
    print(f"link {args.listen} -> {args.target}, {args.one_way_delay_ms:g} ms each way", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        link.serve_forever()
    link.close()
    return 0
