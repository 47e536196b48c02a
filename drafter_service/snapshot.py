"""Snapshots of the global suffix trees on disk, so a restarted drafter starts warm.

Writes go to a temporary file in the same directory, are fsynced, then renamed
over the old snapshot: a kill at any moment leaves the old or the new one whole.
A snapshot that fails the core's checks (magic, format version, checksum,
structure) is refused with a log line and the drafter starts cold.
"""

import os
import pathlib

import structlog

log = structlog.get_logger()


def save(engine, path: pathlib.Path) -> int:
    """Writes the engine's snapshot atomically; returns its size in bytes."""
    data = engine.core.snapshot()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
    return len(data)


def load(engine, path: pathlib.Path) -> bool:
    """Restores the engine from `path` if a valid snapshot is there; never raises on bad files."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        log.info("snapshot_absent", path=str(path))
        return False
    except OSError as exc:
        log.warning("snapshot_refused", path=str(path), reason=str(exc), action="starting cold")
        return False
    try:
        engine.restore(data)
    except ValueError as exc:
        log.warning("snapshot_refused", path=str(path), reason=str(exc), action="starting cold")
        return False
    log.info("snapshot_restored", path=str(path), cached_requests=len(engine.core.cached_requests()),
             cached_tokens=engine.core.cached_tokens(), memory_bytes=engine.core.memory_bytes())
    return True
