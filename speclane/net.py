"""Addresses on this host, and waiting for a server on one."""

import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def probe_http(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> tuple[bool, str]:
    """Whether GET `url` answers 200, and what it answered; `context` checks an https
    server (default: the system's CAs). Never through a proxy: an HTTP(S)_PROXY in
    the environment must not reroute a probe of a local service."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url, timeout=timeout) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as error:  # 4xx/5xx, e.g. 503 while no verifier is serving
        return False, f"HTTP {error.code}"
    except (OSError, ValueError) as error:  # refused, unreachable, timed out, bad URL
        return False, str(getattr(error, "reason", error))


def http_ok(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> bool:
    return probe_http(url, timeout, context)[0]


def wait_http_ok(url: str, process: subprocess.Popen | None = None, timeout: float = 600.0) -> None:
    """Waits until GET `url` answers 200; raises if `process` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not http_ok(url):
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)
