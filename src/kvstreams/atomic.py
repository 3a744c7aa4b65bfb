"""Atomic file writes (write to a temporary file beside the target, then rename over it) and
directory locks (one process at a time in a run directory)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
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


def sha256(*paths: Path) -> str:
    """Hex sha256 of a file (or of several, one after the other), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def write_json(path: str | Path, data: object) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))


LOCK = "running.lock"
_HELD: dict[Path, int] = {}  # lock path -> the open descriptor whose flock this process holds


def claim(directory: Path, name: str = LOCK) -> bool:
    """Take ``directory`` for this process; False when another live process holds it.

    The lock is an exclusive ``flock`` on ``directory/name``, held for as long as this process keeps
    the file open: the kernel releases it when the holder dies (``kill -9`` included), so a dead
    run's lock is free whatever the file says (empty, garbage, a recycled pid) and no process ever
    has to decide that a lock is stale and delete it -- the step that let two restarts both win.
    The file holds the holder's pid, for messages only."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = (directory / name).absolute()
    if lock in _HELD:
        return True
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:  # the file we locked must still be the one at this path (a holder may have released it)
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[lock] = fd
    return True


def release(directory: Path, name: str = LOCK) -> None:
    """Give the lock up: remove the file while still holding it, then close. Never raises: an error
    here (a filesystem turned read-only) is one line, and must not replace the error a run ends with."""
    lock = (directory / name).absolute()
    fd = _HELD.pop(lock, None)
    if fd is None:
        return  # not ours: another process's file must stay (removing it would let a third one in)
    try:
        _unlink(directory, name)
    except OSError as err:
        print(f"kvstreams: could not remove the lock {lock} ({err.strerror or err})", file=sys.stderr)
    os.close(fd)  # the kernel drops the flock with the last descriptor


def _unlink(directory: Path, name: str) -> None:
    (directory / name).unlink(missing_ok=True)


def holder(directory: Path, name: str = LOCK) -> str:
    """The pid written in ``directory``'s lock (for messages)."""
    try:
        return (directory / name).read_text().strip()
    except OSError:
        return "?"
