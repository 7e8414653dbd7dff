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


_RUNNING = """
import sys, time
from warehouse import Warehouse
wh = Warehouse(sys.argv[1])
lock = wh.hold_run("r1")
lock.__enter__()
wh.write_run("r1", model="m", status="running")  # as engine.run: under the lock
print("held", flush=True)
time.sleep(600)
"""


def _runs_row(root: Path) -> tuple[str, bool, str | None]:
    from warehouse.query import connect

    with connect(root) as q:
        rows = q.rows("SELECT status, abandoned, notes FROM runs WHERE run_id = 'r1'")
    assert len(rows) == 1, rows
    return rows[0]


def test_a_run_killed_with_kill9_reads_as_interrupted_and_resumes(tmp_path: Path) -> None:
    """Its record says `running` forever (the process never wrote its end); readers (the
    runs view: `sandflow sql`, the viewer, reports; Warehouse.run_info) see its lock free
    and show it interrupted. A live run is never shown so; resuming takes the run again."""
    from warehouse import Warehouse
    from warehouse.runlock import ABANDONED_NOTE, is_held

    proc = subprocess.Popen(
        [sys.executable, "-c", _RUNNING, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        wh = Warehouse(tmp_path)
        assert is_held(wh.layout, "r1") is True
        assert _runs_row(tmp_path) == ("running", False, None)
        assert (wh.run_info("r1") or {})["status"] == "running"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert is_held(wh.layout, "r1") is False
        status, abandoned, notes = _runs_row(tmp_path)
        assert (status, abandoned) == ("interrupted", True) and notes == ABANDONED_NOTE
        info = wh.run_info("r1") or {}
        assert info["status"] == "interrupted" and ABANDONED_NOTE in info["notes"]
        # the stored row is untouched: only readers say interrupted
        from warehouse.runs import read_run

        assert (read_run(wh.layout, "r1") or {})["status"] == "running"
        with wh.hold_run("r1"):  # resume: the lock is free, the run is live again
            wh.write_run("r1", model="m", status="running")
            assert _runs_row(tmp_path) == ("running", False, None)
            wh.finish_run("r1", status="finished")
        assert _runs_row(tmp_path)[:2] == ("finished", False)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_run_without_a_lock_file_is_not_called_abandoned(tmp_path: Path) -> None:
    """A writer that takes no run lock (an older sandflow): nothing can be told, so its
    `running` stands."""
    from warehouse import Warehouse

    Warehouse(tmp_path).write_run("r1", model="m", status="running")
    assert _runs_row(tmp_path) == ("running", False, None)


def test_readers_probing_a_run_never_make_its_start_refused(tmp_path: Path) -> None:
    """is_held holds a shared flock for microseconds; a run starting at that instant
    retries (PROBE_GRACE_S) instead of refusing."""
    import threading

    from warehouse.runlock import is_held

    layout = Layout(tmp_path)
    lock = RunLock(layout, "r1")
    lock.acquire()
    lock.release()
    stop = threading.Event()
    probes = [0]

    def probe() -> None:
        while not stop.is_set():
            is_held(layout, "r1")
            probes[0] += 1

    readers = [threading.Thread(target=probe) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for _ in range(200):
            lock.acquire()  # wait=False: refuses only a real holder
            lock.release()
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert probes[0] > 200, "the readers hardly probed: the test could not fail"


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
