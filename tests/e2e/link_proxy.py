"""A TCP proxy standing in for the network between two services, for fault tests."""

import contextlib
import select
import socket
import threading


class LinkProxy:
    """A TCP proxy standing in for the network between the gateway and the verifier.
    freeze(): bytes stop flowing, every connection stays open (a hung peer, a dropped
    route). cut(): every connection is reset and new ones are closed at once. restore():
    traffic flows again."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._cut = False
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._flowing.clear()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            for sock in self._sockets:
                _reset(sock)
            self._sockets.clear()
        self._flowing.set()  # frozen pumps wake up, find their sockets closed and end

    def restore(self) -> None:
        with self._lock:
            self._cut = False
        self._flowing.set()

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target, timeout=2)
            except OSError:  # the verifier is down: so is the link
                _reset(client)
                continue
            with self._lock:
                if self._cut:
                    _reset(client), _reset(upstream)
                    continue
                self._sockets.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                self._flowing.wait()
                if not select.select([source], [], [], 0.1)[0] or not self._flowing.is_set():
                    continue
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except (OSError, ValueError):  # ValueError: select on a socket another thread closed
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _reset(sock: socket.socket) -> None:
    """Closes with a TCP reset, as a broken link looks to both ends."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
