"""The per-episode append-only journal: what `record_turn` accepted survives a kill -9.

One JSON line per record (tasks/journal.py's format, read back by its `read_journal`):
the episode header first, then one line per turn, each handed to the kernel with ONE
``write()`` before `record_turn` returns. While an episode is being recorded its writer
holds an exclusive ``flock`` on the journal, so "orphaned" (nobody is writing it any
more: the process died) is a question the kernel answers, across threads and processes,
without a lock server: if we can take the lock, the writer is gone.

What survives what (`Durability`):

- a killed process (kill -9, the OOM killer, a crash of Python): every record
  `start_episode` / `record_turn` returned from, in every mode: a written line is in the
  kernel's page cache, which outlives the process.
- an OS crash or power cut: "turn" (default) fdatasyncs in the background by group
  commit (`_GroupSyncer`): a line normally reaches the disk a few milliseconds after it
  was written (2 ms for the pass to gather, plus the disk's sync), and the loop does not
  wait for it; an episode's next record waits only while MAX_UNSYNCED (4) of its lines
  are still not on disk. So at most the last 4 records of each open episode are lost,
  normally only those of the last few milliseconds. "sync" fdatasyncs inside
  `record_turn` (nothing accepted is lost). "flush" never syncs: recent records may be
  lost.

Finishing an episode writes its Parquet files and then deletes the journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Literal

from datasets_prep.secrets import scrub
from tasks.journal import JournalContents, journal_line, read_journal
from tasks.records import EpisodeRecord, TurnRecord
from warehouse.tempfiles import try_flock

__all__ = [
    "DURABILITIES",
    "Durability",
    "Journal",
    "JournalBusy",
    "JournalContents",
    "is_live",
    "read_journal",
]

Durability = Literal["sync", "turn", "flush"]
DURABILITIES = ("sync", "turn", "flush")

# The syncer waits this long after the first line of a pass is written, so the lines
# other episodes write meanwhile join the same pass (one wake-up for many journals).
GROUP_COMMIT_S = 0.002
# durability "turn": lines of one journal that may be written but not yet on disk. The
# next write waits while this many are pending, so a slow disk slows the episode down
# rather than widening what an OS crash can take (at most this many records per episode).
MAX_UNSYNCED = 4


class _GroupSyncer:
    """One background thread per process that fdatasyncs journals off the callers' path.

    Group commit: a write marks its journal dirty; the syncer takes every dirty journal
    at once (one pass, GROUP_COMMIT_S after the first mark, so lines written meanwhile by
    other episodes join it), fdatasyncs each, then records how far each is on disk. The
    callers never wait for a pass, except a journal's next line while MAX_UNSYNCED of its
    lines are still not on disk (a disk that cannot keep up) and the close of a journal
    kept as an orphan (synced first).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.work = threading.Condition(self.lock)  # the syncer waits here for dirty journals
        self.done = threading.Condition(self.lock)  # writers wait here for a pass to end
        self._dirty: dict[Journal, None] = {}  # an ordered set
        self._pid = -1
        self.passes = 0
        self.syncs = 0

    def mark(self, journal: Journal) -> None:
        """`journal` has lines not on disk (caller holds `lock`)."""
        if self._pid != os.getpid():  # first use in this process (or after a fork)
            self._dirty = {}
            threading.Thread(target=self._run, name="journal-sync", daemon=True).start()
            self._pid = os.getpid()
        if journal not in self._dirty:
            self._dirty[journal] = None
            self.work.notify()

    def forget(self, journal: Journal) -> None:
        """`journal` closes without waiting for its last lines (caller holds `lock`)."""
        self._dirty.pop(journal, None)

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self._dirty:
                    self.work.wait()
            time.sleep(GROUP_COMMIT_S)
            with self.lock:
                batch = [(j, j._written) for j in self._dirty]
                self._dirty.clear()
                for j, _ in batch:
                    j._syncing = True
                self.passes += 1
                self.syncs += len(batch)
            for j, upto in batch:
                err: OSError | None = None
                try:
                    os.fdatasync(j._fd)
                except OSError as exc:  # EIO, ENOSPC: raised by the journal's next call
                    err = exc
                with self.lock:
                    j._syncing = False
                    if err is None:
                        j._synced = max(j._synced, upto)
                    else:
                        j._sync_error = err
                    if j._closed:  # closed while we held its fd: ours to close
                        with contextlib.suppress(OSError):
                            os.close(j._fd)
                    self.done.notify_all()


_SYNCER = _GroupSyncer()


class JournalBusy(RuntimeError):
    """Another live writer is recording this episode right now."""


class Journal:
    """An open journal; holds the episode's lock until closed."""

    def __init__(self, path: Path, episode: EpisodeRecord, durability: Durability = "turn") -> None:
        if durability not in DURABILITIES:
            raise ValueError(
                f"durability must be one of {', '.join(DURABILITIES)}, not {durability!r}"
            )
        self.path = path
        self.durability = durability
        self._written = 0  # lines handed to the kernel
        self._synced = 0  # lines known to be on disk (durability turn/sync)
        self._syncing = False  # the syncer is inside fdatasync(self._fd)
        self._sync_error: OSError | None = None
        self._closed = False
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JournalBusy(
                f"episode {episode.episode_id} of run {episode.run_id} is being recorded by "
                f"another live writer (journal {path} is locked)"
            ) from None
        if os.fstat(fd).st_size:  # a stale journal (normally recovered before we get here)
            os.ftruncate(fd, 0)
        self._fd = fd
        header = episode.model_dump(mode="json")
        header["config"] = scrub(header.get("config") or {})
        header["prompt_messages"] = scrub(header.get("prompt_messages") or [])
        self._write(journal_line("start", header))

    def _write(self, line: str) -> None:
        data = line.encode("utf-8")
        if self.durability == "turn" and (
            self._written - self._synced >= MAX_UNSYNCED or self._sync_error is not None
        ):
            self._wait_synced(MAX_UNSYNCED - 1)  # the disk is behind: let it catch up
        view = memoryview(data)
        while view:  # one write() for a whole line; a short write (rare) is continued
            view = view[os.write(self._fd, view) :]
        self._written += 1
        if self.durability == "sync":
            os.fdatasync(self._fd)
            self._synced = self._written
        elif self.durability == "turn":
            with _SYNCER.lock:
                _SYNCER.mark(self)

    def _raise_sync_error(self) -> None:
        if self._sync_error is not None:
            err, self._sync_error = self._sync_error, None
            raise OSError(err.errno, f"syncing the journal {self.path} failed: {err.strerror}")

    def append(self, turn: TurnRecord) -> None:
        self._write(journal_line("turn", turn))

    def wait_synced(self) -> None:
        """Block until every line written so far is on disk (durability turn/sync)."""
        self._wait_synced(0)

    def _wait_synced(self, pending: int) -> None:
        """Block until at most `pending` written lines are not on disk (durability turn)."""
        if self.durability != "turn":
            return
        with _SYNCER.lock:
            while self._written - self._synced > pending and self._sync_error is None:
                if not self._syncing:
                    _SYNCER.mark(self)
                _SYNCER.done.wait()
            self._raise_sync_error()

    def close(self, *, remove: bool) -> None:
        """Release the lock; with remove=True the journal is deleted first (episode committed).

        A journal kept (remove=False: an orphan to recover) is synced first. A committed
        one is not waited for (its episode is in the Parquet files): if the syncer is
        inside its fdatasync right now, the syncer closes the fd when that returns.
        """
        if self._closed:
            return
        if not remove:
            # closing anyway on a sync error: the lines are written (a kill -9 keeps them)
            with contextlib.suppress(OSError):
                self.wait_synced()
        else:
            self.path.unlink(missing_ok=True)
        with _SYNCER.lock:
            _SYNCER.forget(self)
            self._closed = True
            if self._syncing:
                return  # the syncer closes it
        os.close(self._fd)


def is_live(path: Path) -> bool:
    """True when some writer (any thread or process on this host) holds the journal's lock."""
    try:
        with try_flock(path) as fd:
            return fd is None
    except FileNotFoundError:
        return False
