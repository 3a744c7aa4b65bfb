"""Atomic file writes (write to a temporary file beside the target, then rename over it) and
directory locks (one process at a time in a run directory)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``; on any failure nothing is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def ensure_writable(directory: Path, what: str) -> None:
    """Make ``directory`` if missing and check a file can be created in it: an unwritable output path
    is one line before any compute is spent, not an error after it."""
    from kvstreams.errors import KVStreamsError

    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise KVStreamsError(f"{what} {str(directory)!r} is not writable: {err.strerror or err}") from None


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: str | Path, data: object) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))


LOCK = "running.lock"


def claim(directory: Path, name: str = LOCK) -> bool:
    """Take ``directory`` for this process (a lock file ``name`` holding its pid); False when another
    live process holds it. A lock left by a dead process is taken over."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / name
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _alive(lock):
                return False
            lock.unlink(missing_ok=True)  # its holder died: take the run over
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def release(directory: Path, name: str = LOCK) -> None:
    (directory / name).unlink(missing_ok=True)


def _alive(lock: Path) -> bool:
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return False
    if pid == os.getpid():
        return False  # our own stale lock (an earlier attempt in this process)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder(directory: Path, name: str = LOCK) -> str:
    """The pid written in ``directory``'s lock (for messages)."""
    try:
        return (directory / name).read_text().strip()
    except OSError:
        return "?"
