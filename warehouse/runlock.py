"""One run id, one writer: a kernel lock on ``_journal/run_id=R/.run.lock``.

Two processes resuming the same run id would both run every pending episode and mix
their attempts in the stored run. The process that runs a run id holds an exclusive
``flock`` on the run's lock file for the whole run; a second one is refused with a message
naming the run and the holder (pid, host, start time, command), or waits for it when
asked. The kernel releases an flock when its holder dies, kill -9 included, so a crashed
run never leaves a stale lock behind, and no pid file has to be trusted.

Shared warehouses: on a local disk the lock holds between every process of the host. On
NFS, Linux emulates flock with NFS byte-range locks (NLM / NFSv4), which hold across
client hosts; a client host that dies keeps its lock until the server's lease runs out
(NFSv4: about 90 s), after which the run can be resumed. Mounted with ``local_lock=flock``
or ``local_lock=all`` the lock is local to each client and two hosts could run one run id
at once: `shared_lock_warning` says so (the run flow prints it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sandbox.procs import pid_alive
from warehouse.layout import Layout
from warehouse.tempfiles import try_flock

LOCK_NAME = ".run.lock"
# A reader asking whether a run is held (`is_held`) holds a shared flock for microseconds;
# a writer starting at that instant retries this long before it calls the run taken (so a
# refusal, or a `wait` shorter than this, takes this long).
PROBE_GRACE_S = 1.0
ABANDONED_NOTE = (
    "its process ended without recording how the run ended (killed?): "
    "resume it with the same --run-id"
)


class RunLocked(RuntimeError):
    """Another process holds the run (the message names it)."""

    def __init__(self, message: str, holder: Holder | None) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: str  # UTC, ISO 8601
    command: str

    def describe(self) -> str:
        where = f"pid {self.pid} on {self.host}"
        if self.host == socket.gethostname() and not _alive(self.pid):
            where += " (gone: a child process it started may still hold the lock)"
        return f"{where}, started {self.started}" + (f": {self.command}" if self.command else "")


_alive = pid_alive


def read_holder(path: Path) -> Holder | None:
    """Who holds (or last held) the lock, as its holder wrote it."""
    for _ in range(20):  # the holder writes its name right after taking the lock
        try:
            data = json.loads(path.read_text(encoding="utf-8") or "null")
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            try:
                return Holder(
                    pid=int(data["pid"]),
                    host=str(data["host"]),
                    started=str(data["started"]),
                    command=str(data.get("command", ""))[:200],
                )
            except (KeyError, TypeError, ValueError):
                return None
        time.sleep(0.05)
    return None


class RunLock:
    """The exclusive lock of one run id in one warehouse (released by `release` or death)."""

    def __init__(self, layout: Layout, run_id: str) -> None:
        self.run_id = run_id
        self.path = layout.journal_dir(run_id) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(
        self,
        wait: bool | float = False,
        on_wait: Callable[[Holder | None], None] | None = None,
        poll_s: float = 0.25,
        record: bool = True,
    ) -> None:
        """Take the lock, or raise RunLocked naming the holder.

        wait: False refuses at once; True waits as long as it takes; a number waits that
        many seconds. `on_wait(holder)` is called once when waiting starts. `record`:
        write this process into the lock file (a mere probe leaves the last holder's name).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = None if wait is True else time.monotonic() + (float(wait) if wait else 0.0)
        grace = time.monotonic() + PROBE_GRACE_S
        told = False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    now = time.monotonic()
                    if deadline is not None and now >= deadline and now < grace:
                        time.sleep(0.01)  # maybe a reader's probe (is_held): not yet a refusal
                        continue
                    holder = read_holder(self.path)
                    if deadline is not None and time.monotonic() >= deadline:
                        raise RunLocked(self._refusal(holder, wait), holder) from None
                    if not told and on_wait is not None:
                        on_wait(holder)
                    told = True
                    time.sleep(poll_s)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        if not record:
            return
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            # the command, not its options: an endpoint URL may carry credentials
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:3]])[:120],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)

    def _refusal(self, holder: Holder | None, wait: bool | float) -> str:
        who = holder.describe() if holder else "another process (it has not said who yet)"
        waited = f" (waited {float(wait):g} s)" if wait else ""
        return (
            f"run {self.run_id} is being run by {who}{waited}. One run id has one writer: "
            "wait for it to end (or stop it), or pass --wait to start when it does; "
            f"a run killed with kill -9 releases its lock at once. Lock file: {self.path}"
        )

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # releases the flock; the file stays (its content: the last holder)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def is_held(layout: Layout, run_id: str) -> bool | None:
    """Does some process hold run `run_id`'s lock right now? None when the run has no
    lock file (its writer takes none, or it ran elsewhere): it cannot be told.

    A run recorded `running` whose lock is free was abandoned: its process died without
    recording the end (kill -9, OOM, power), since a live run holds its lock from before
    its record says `running` until after it says how it ended. The probe is a shared
    flock held for microseconds: it never blocks a run, and a run starting at that
    instant retries (PROBE_GRACE_S) instead of refusing.
    """
    try:
        path = RunLock(layout, run_id).path
    except ValueError:
        return None
    try:
        with try_flock(path, shared=True) as fd:
            return fd is None
    except OSError:
        return None


def refusal(layout: Layout, run_id: str) -> RunLocked | None:
    """What starting run `run_id` would meet now: RunLocked naming the holder, or None
    (free, or no such lock). A probe (is_held): it never takes the lock."""
    if is_held(layout, run_id) is not True:
        return None
    lock = RunLock(layout, run_id)
    holder = read_holder(lock.path)
    return RunLocked(lock._refusal(holder, False), holder)


def abandoned(layout: Layout, run_ids: list[str]) -> list[str]:
    """Of runs recorded `running`, those whose lock is free (see is_held)."""
    return [r for r in run_ids if is_held(layout, r) is False]


@contextlib.contextmanager
def hold_run(
    layout: Layout,
    run_id: str,
    wait: bool | float = False,
    on_wait: Callable[[Holder | None], None] | None = None,
) -> Iterator[RunLock]:
    """The run's lock for the block (see RunLock.acquire)."""
    lock = RunLock(layout, run_id)
    lock.acquire(wait=wait, on_wait=on_wait)
    try:
        yield lock
    finally:
        lock.release()


def shared_lock_warning(path: Path) -> str | None:
    """A warning when `path` is on a network filesystem where flock may not exclude other
    hosts (NFS with local_lock=flock|all; CIFS, sshfs and other FUSE filesystems)."""
    mount = _mount_of(path)
    if mount is None:
        return None
    fstype, options, point = mount
    opts = set(options.split(","))
    if fstype.startswith("nfs") and ({"local_lock=flock", "local_lock=all"} & opts):
        return (
            f"the warehouse is on NFS ({point}) mounted with local_lock: the run lock only "
            "excludes processes of this host; never run one run id from two hosts at once"
        )
    if fstype in ("cifs", "smb3", "9p") or fstype.startswith("fuse"):
        return (
            f"the warehouse is on a {fstype} filesystem ({point}): whether the run lock excludes "
            "other hosts depends on the server; never run one run id from two hosts at once"
        )
    return None


def _mount_of(path: Path) -> tuple[str, str, str] | None:
    try:
        real = str(path.resolve())
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best: tuple[str, str, str] | None = None
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (
            best is None or len(point) > len(best[2])
        ):
            best = (parts[2], parts[3], point)
    return best
