"""The run lock and the temporary-file protocol, with real processes and real flocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warehouse.layout import Layout
from warehouse.runlock import RunLock, RunLocked, read_holder
from warehouse.tempfiles import locked_temp, remove_dead_temps

REPO = Path(__file__).resolve().parents[2]

_HOLDER = """
import sys, time
from warehouse.layout import Layout
from warehouse.runlock import RunLock
RunLock(Layout(sys.argv[1]), "r1").acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_run_is_refused_naming_the_holder_and_freed_by_kill9(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    try:
        lock = RunLock(Layout(tmp_path), "r1")
        with pytest.raises(RunLocked) as err:
            lock.acquire()
        msg = str(err.value)
        assert "run r1" in msg and f"pid {proc.pid}" in msg and socket.gethostname() in msg
        assert "started 20" in msg and "--wait" in msg
        assert err.value.holder is not None and err.value.holder.pid == proc.pid
        t0 = time.monotonic()
        with pytest.raises(RunLocked, match=r"waited 0\.5 s"):
            lock.acquire(wait=0.5)
        assert time.monotonic() - t0 >= 0.5
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        lock.acquire()  # the kernel released it with its holder's death
        holder = read_holder(lock.path)
        assert holder is not None and holder.pid == os.getpid()
        lock.release()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_waiting_for_a_run_starts_when_it_ends(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    told: list[object] = []
    try:
        lock = RunLock(Layout(tmp_path), "r1")
        import threading

        threading.Timer(1.0, lambda: os.kill(proc.pid, signal.SIGTERM)).start()
        lock.acquire(wait=True, on_wait=told.append)
        assert len(told) == 1 and getattr(told[0], "pid", None) == proc.pid
        lock.release()
    finally:
        proc.kill()
        proc.wait()


def test_a_probe_leaves_the_last_holders_name(tmp_path: Path) -> None:
    first = RunLock(Layout(tmp_path), "r1")
    first.acquire()
    first.release()
    probe = RunLock(Layout(tmp_path), "r1")
    probe.acquire(record=False)
    probe.release()
    holder = read_holder(first.path)
    assert holder is not None and holder.pid == os.getpid()


def test_a_cleaner_never_removes_a_temp_file_being_written(tmp_path: Path) -> None:
    dest = tmp_path / "x.parquet"
    with locked_temp(dest) as (tmp, fh):
        fh.write(b"data")
        assert remove_dead_temps(tmp_path) == []
        assert tmp.exists()
        os.replace(tmp, dest)
    assert dest.read_bytes() == b"data"
    # a dead one (nobody holds it) goes; other hidden files and data files stay
    dead = tmp_path / ".y.parquet.abcd1234.tmp"
    dead.write_bytes(b"half")
    (tmp_path / ".keep").write_text("x")
    assert remove_dead_temps(tmp_path) == [dead]
    assert dest.exists() and (tmp_path / ".keep").exists()


def test_a_writer_that_loses_the_create_lock_race_starts_over(tmp_path: Path, monkeypatch) -> None:
    """A cleaner that removes a temp file between its creation and its writer's flock."""
    import fcntl

    import warehouse.tempfiles as T

    real_flock = fcntl.flock
    raced: list[Path] = []

    def flock_after_a_cleaner(fd: int, op: int) -> None:
        if not raced:
            victim = next(tmp_path.glob(".*.tmp"))
            raced.append(victim)
            assert remove_dead_temps(tmp_path) == [victim]  # the cleaner wins the race
        real_flock(fd, op)

    monkeypatch.setattr(T.fcntl, "flock", flock_after_a_cleaner)
    with locked_temp(tmp_path / "z.parquet") as (tmp, fh):
        fh.write(b"ok")
        os.replace(tmp, tmp_path / "z.parquet")
    assert raced and tmp != raced[0]
    assert (tmp_path / "z.parquet").read_bytes() == b"ok"
