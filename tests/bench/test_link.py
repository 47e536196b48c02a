"""The delayed link (`speclane bench link`) between a client and an echo server."""

import socket
import threading
import time

from speclane.net import free_port
from speclane_cli.bench.link import Link

ONE_WAY_SECONDS = 0.1


def echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        connection, _ = server.accept()
        with connection:
            while data := connection.recv(1024):
                connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_every_byte_crosses_in_order_a_round_trip_later():
    server = echo_server()
    listen = f"127.0.0.1:{free_port()}"
    link = Link(listen, f"127.0.0.1:{server.getsockname()[1]}", ONE_WAY_SECONDS)
    threading.Thread(target=link.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", int(listen.rsplit(":", 1)[1])), timeout=5) as client:
            sent = time.monotonic()
            # Three chunks in flight at once: each is held, none waits for the one before.
            for chunk in (b"first ", b"second ", b"third"):
                client.sendall(chunk)
                time.sleep(0.01)
            echoed = b""
            while len(echoed) < len(b"first second third"):
                echoed += client.recv(1024)
            elapsed = time.monotonic() - sent
            assert echoed == b"first second third"
            assert 2 * ONE_WAY_SECONDS <= elapsed < 3 * ONE_WAY_SECONDS  # one after another: 6
            client.shutdown(socket.SHUT_WR)
            assert client.recv(1024) == b""  # the close crosses too
    finally:
        link.close()
        server.close()
