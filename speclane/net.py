"""Addresses on this host, and waiting for a server on one."""

import socket
import subprocess
import time
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


def wait_http_ok(url: str, process: subprocess.Popen | None = None, timeout: float = 600.0) -> None:
    """Waits until GET `url` answers 200; raises if `process` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not http_ok(url):
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)
