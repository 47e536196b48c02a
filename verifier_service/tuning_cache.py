"""Start-up measurements kept between starts, as Triton and FlashInfer keep
their autotuning: a result is stored under a hash of everything it depends on
(the host's CPU, the libraries, the thread count, the shapes or the model, the
code), so a restart on the same host reads it instead of measuring again, and
any change to those inputs measures afresh. A result only decides how the
verifier goes about its work (which way to multiply, how long a draft pays),
never what it computes, so a stale or missing file costs speed, never output.

A measurement is stored only when the cores were quiet while it ran: here one
taken beside a package build chose slower ways to multiply and a draft-token
cost 3-4x the true one, and every later start on that host read them back."""

import hashlib
import json
import os
import pathlib
import platform
import tempfile

import structlog
import torch

log = structlog.get_logger()

# A measurement is stored only where other processes (or the hypervisor, as steal time) took at most this share
# of the cores this process may run on while it ran: an idle 2-core host shows 0-2%, a package build 40-100%.
# Plus a few clock ticks (10 ms each), within which /proc/stat and this process's own times disagree.
QUIET_SHARE, QUIET_SLACK_S = 0.1, 0.05


def host_fingerprint() -> dict:
    """What a measurement on this CPU depends on beyond the code: its model,
    instruction sets and caches, as /proc/cpuinfo and lscpu's sources show them."""
    fields = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("model name", "flags", "cache size") and name not in fields:
                fields[name] = value.strip()
    except OSError:
        fields["processor"] = platform.processor()
    fields["cpus"] = os.cpu_count()
    return fields


def runtime_key() -> dict:
    """What every measurement of a pass depends on beyond the code and its inputs: the CPU, torch, its threads."""
    return {"host": host_fingerprint(), "torch": torch.__version__, "threads": torch.get_num_threads()}


def file_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_fingerprint(package: pathlib.Path) -> str:
    """A hash of a package's code (Python sources and built extensions): a measurement of
    what the code does is stored under it, so any change to the code measures again."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".so") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(package)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _path(directory: pathlib.Path, name: str, key: dict) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"{name}-{digest}.json"


def load(directory: pathlib.Path | None, name: str, key: dict):
    """The value stored for (name, key), or None (no directory, none stored, or unreadable)."""
    if directory is None:
        return None
    try:
        stored = json.loads(_path(directory, name, key).read_text())
    except (OSError, ValueError):
        return None
    # As JSON holds it (tuples as lists): a hash collision must not pass for a match.
    return stored.get("value") if stored.get("key") == json.loads(json.dumps(key)) else None


def store(directory: pathlib.Path | None, name: str, key: dict, value) -> None:
    """Stores value for (name, key), atomically (verifiers may start together);
    a directory that cannot be written only costs the next start a measurement."""
    if directory is None:
        return
    path = _path(directory, name, key)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as out:
            json.dump({"key": key, "value": value}, out)
        os.replace(out.name, path)
    except OSError as error:
        log.warning("tuning_cache_not_written", path=str(path), error=str(error))


def store_measured(directory: pathlib.Path | None, name: str, key: dict, value, watch: "CoreWatch",
                   on_host_cores: bool = True) -> bool:
    """Stores a measurement taken inside `watch` only if the cores were quiet meanwhile, or if it did not run on
    them (`on_host_cores` False: an accelerator's passes); returns whether it was kept for later starts."""
    if on_host_cores and not watch.quiet:
        log.warning("tuning_not_stored", name=name, others_share=watch.others_share,
                    reason="other processes used the cores while it was measured")
        return False
    store(directory, name, key, value)
    return directory is not None


class CoreWatch:
    """A context that measures what share of this process's cores' time others
    took while it ran (`others_share`; None where the kernel does not say, as
    off Linux), from /proc/stat's per-CPU counters less this process's own CPU
    time. `quiet` says whether a measurement taken inside may be stored."""

    others_share: float | None = None
    _others_s = _total_s = 0.0

    def __enter__(self) -> "CoreWatch":
        self._start = _core_seconds()
        return self

    def __exit__(self, *exc) -> None:
        end = _core_seconds()
        if self._start is not None and end is not None:
            (busy0, total0, own0), (busy1, total1, own1) = self._start, end
            self._others_s, self._total_s = max(0.0, (busy1 - busy0) - (own1 - own0)), total1 - total0
            if self._total_s > 0:
                self.others_share = round(self._others_s / self._total_s, 3)

    @property
    def quiet(self) -> bool:
        return self.others_share is None or self._others_s <= QUIET_SHARE * self._total_s + QUIET_SLACK_S


def _core_seconds() -> tuple[float, float, float] | None:
    """(busy, total) seconds of the CPUs this process may run on, since boot, and
    this process's own CPU seconds; None where /proc/stat cannot be read."""
    try:
        cpus = {f"cpu{cpu}" for cpu in os.sched_getaffinity(0)}
        lines = pathlib.Path("/proc/stat").read_text().splitlines()
    except (OSError, AttributeError):
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if name in cpus:
            # user nice system idle iowait irq softirq steal (guest time is already in user)
            ticks = [int(field) for field in fields[:8]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy / hz, total / hz, own.user + own.system
