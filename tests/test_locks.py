"""The run lock (one process per run directory): held by the kernel, not inferred from a pid.

Found by probing: with a stale lock, simultaneous restarts could each remove "the stale lock" and one
another's fresh one (two holders in 4 of 200 trials of 6 restarts); an empty lock file (a kill between
create and write) blocked its directory forever; a recycled pid kept a dead run's lock alive; and an
error while releasing replaced the run's real error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvstreams.atomic import LOCK, claim, holder, release
from kvstreams.errors import KVStreamsError

_HOLD = """
import os, sys, time
from pathlib import Path
from kvstreams.atomic import claim
directory, start, holders, hold = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
while time.time() < start:
    time.sleep(0.001)
if claim(directory):
    fd = os.open(holders, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{os.getpid()}\\n".encode())
    os.close(fd)
    print("held", flush=True)
time.sleep(hold)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _start(directory, holders, hold: float, start: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(directory), str(start), str(holders), str(hold)],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_simultaneous_restarts_over_a_stale_lock_give_one_holder(tmp_path):
    for trial in range(25):
        d = tmp_path / f"run{trial}"
        d.mkdir()
        (d / LOCK).write_text(str(_dead_pid()))  # left by a kill -9
        holders = tmp_path / f"holders{trial}"
        start = time.time() + 0.4
        procs = [_start(d, holders, 0.5, start) for _ in range(6)]
        for p in procs:
            p.wait()
        assert len(holders.read_text().split()) == 1, f"trial {trial}: {holders.read_text().split()}"


def test_a_live_holder_keeps_its_lock_and_its_death_frees_it(tmp_path):
    p = _start(tmp_path, tmp_path / "holders", 30.0)
    try:
        assert p.stdout.readline().strip() == "held"
        assert not claim(tmp_path) and holder(tmp_path) == str(p.pid)
    finally:
        p.kill()
        p.wait()
    assert claim(tmp_path)  # the kernel released the dead holder's lock: taken over, no pid check
    assert (tmp_path / LOCK).read_text() == str(os.getpid())
    release(tmp_path)
    assert not (tmp_path / LOCK).exists()


@pytest.mark.parametrize(
    "content",
    ["", "   ", "not a pid", "__LIVE__"],
    ids=["empty (killed between create and write)", "blank", "garbage", "a recycled pid"],
)
def test_a_lock_file_nobody_holds_is_taken_over_whatever_it_says(content, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # a live process that is not a kvstreams holder, as a recycled pid would be
        (tmp_path / LOCK).write_text(content.replace("__LIVE__", str(sleeper.pid)))
        assert claim(tmp_path)
    finally:
        sleeper.kill()
        release(tmp_path)


def test_an_error_while_releasing_does_not_replace_the_runs_error(model_dirs, tmp_path, monkeypatch, capsys):
    import kvstreams.atomic as atomic
    import kvstreams.loop as loop
    from test_train import small_config

    def fail(*args, **kwargs):
        raise KVStreamsError("the real error")

    def read_only(directory, name=LOCK):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(loop, "_train", fail)
    monkeypatch.setattr(atomic, "_unlink", read_only)
    with pytest.raises(KVStreamsError, match="the real error"):
        loop.train(small_config(model_dirs["qwen3"], tmp_path), show_progress=False)
    assert "could not remove the lock" in capsys.readouterr().err


def test_releasing_a_lock_this_process_does_not_hold_leaves_it_to_its_holder(tmp_path):
    p = _start(tmp_path, tmp_path / "holders", 30.0)
    try:
        assert p.stdout.readline().strip() == "held"
        release(tmp_path)  # e.g. the runner finding a finished warm start another worker holds
        assert (tmp_path / LOCK).exists() and not claim(tmp_path)
    finally:
        p.kill()
        p.wait()
