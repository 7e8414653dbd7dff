"""The per-episode append-only journal: a crash loses at most the turn in flight.

One JSON line per record (tasks/journal.py's format, read back by its `read_journal`):
the episode header first, then one line per turn, each written, flushed and (by default) fdatasync'ed before `record_turn` returns. While an
episode is being recorded its writer holds an exclusive ``flock`` on the journal, so
"orphaned" (nobody is writing it any more: the process died) is a question the kernel
answers, across threads and processes, without a lock server: if we can take the lock,
the writer is gone.

Finishing an episode writes its Parquet files and then deletes the journal.
"""

from __future__ import annotations

import fcntl
import os
import queue
import threading
from pathlib import Path
from typing import Literal

from datasets_prep.secrets import scrub
from tasks.journal import JournalContents, journal_line, read_journal
from tasks.records import EpisodeRecord, TurnRecord

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


class _Syncer:
    """One background thread per process that fdatasyncs journals off the caller's path.

    With durability="turn", `record_turn` writes and flushes the line (a killed process
    loses nothing) and hands the disk wait to this thread; the next append of the same
    journal first waits for that sync. So at any instant at most the last recorded turn
    is not yet on disk, and the agent loop does not wait for the disk between a turn and
    the next model call.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, threading.Event]] = queue.SimpleQueue()
        self._pid = -1
        self._lock = threading.Lock()

    def submit(self, fd: int) -> threading.Event:
        with self._lock:
            if self._pid != os.getpid():  # first use in this process (or after a fork)
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._run, name="journal-sync", daemon=True).start()
                self._pid = os.getpid()
        done = threading.Event()
        self._queue.put((fd, done))
        return done

    def _run(self) -> None:
        q = self._queue
        while True:
            fd, done = q.get()
            try:
                os.fdatasync(fd)
            except OSError:
                pass  # fd closed early is impossible (close waits); a failing disk shows up elsewhere
            finally:
                done.set()


_SYNCER = _Syncer()


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
        self._pending: threading.Event | None = None
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
        self._fh = os.fdopen(fd, "a", encoding="utf-8")
        header = episode.model_dump(mode="json")
        header["config"] = scrub(header.get("config") or {})
        header["prompt_messages"] = scrub(header.get("prompt_messages") or [])
        self._write(journal_line("start", header))

    def _write(self, line: str) -> None:
        if self._pending is not None:  # the previous line's sync must be done first
            self._pending.wait()
            self._pending = None
        self._fh.write(line)
        self._fh.flush()
        if self.durability == "sync":
            os.fdatasync(self._fh.fileno())
        elif self.durability == "turn":
            self._pending = _SYNCER.submit(self._fh.fileno())

    def append(self, turn: TurnRecord) -> None:
        self._write(journal_line("turn", turn))

    def wait_synced(self) -> None:
        """Block until every line written so far is on disk (durability turn/sync)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def close(self, *, remove: bool) -> None:
        """Release the lock; with remove=True the journal is deleted first (episode committed)."""
        if self._fh.closed:
            return
        self.wait_synced()  # never close an fd the syncer is about to use
        if remove:
            self.path.unlink(missing_ok=True)
        self._fh.close()


def is_live(path: Path) -> bool:
    """True when some writer (any thread or process on this host) holds the journal's lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
