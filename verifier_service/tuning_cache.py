"""Start-up measurements kept between starts, as Triton and FlashInfer keep
their autotuning: a result is stored under a hash of everything it depends on
(the host's CPU, the libraries, the thread count, the shapes or the model, the
code), so a restart on the same host reads it instead of measuring again, and
any change to those inputs measures afresh. A result only decides how the
verifier goes about its work (which way to multiply, how long a draft pays),
never what it computes, so a stale or missing file costs speed, never output."""

import hashlib
import json
import os
import pathlib
import platform
import tempfile

import structlog
import torch

log = structlog.get_logger()


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
