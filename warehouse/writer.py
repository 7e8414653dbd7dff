"""EpisodeWriter: the `tasks.records.Recorder` that stores episodes in the warehouse.

The agent loop calls start_episode -> record_turn (each turn) -> finish_episode. Turns go
to the episode's journal as they happen (durable before record_turn returns); finishing
writes ``turns/run_id=R/<episode_id>.<write_id>.parquet`` and then
``episodes/run_id=R/<episode_id>.parquet`` (the commit point), each atomically, then
deletes the journal.

Safe for many threads and processes at once: each episode writes only its own files, the
per-writer state is guarded by a lock, and no DuckDB database file is ever opened for
writing (DuckDB only reads the Parquet files).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from datasets_prep.closing import ClosedOnExit
from tasks.records import EpisodeRecord, TurnRecord
from warehouse.commit import RecordError, commit_episode
from warehouse.journal import DURABILITIES, Durability, Journal, is_live
from warehouse.layout import Layout, check_episode_id, new_id
from warehouse.recovery import recover_journal
from warehouse.schema import check_run_id

log = logging.getLogger(__name__)


@dataclass
class _Open:
    episode: EpisodeRecord
    journal: Journal
    turns: list[TurnRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class EpisodeWriter(ClosedOnExit):
    """Recorder writing to the warehouse at `root`; one instance may serve many threads.

    Durability: what survives what, exactly.

    - kill -9, the OOM killer, a crash of Python (every mode): nothing `record_turn` or
      `start_episode` returned from is lost. Each record is handed to the kernel with one
      ``write()`` before the call returns, and the page cache outlives the process; the
      next run recovers the orphaned journal (its turns, as an `interrupted` episode).
      An episode `finish_episode` returned from is committed (its Parquet files renamed
      into place).
    - an OS crash or power cut:
      - "turn" (default): at most the last 4 records (journal.MAX_UNSYNCED) of each
        episode still open are lost, normally only those written in the last few
        milliseconds. A background syncer fdatasyncs every journal written since its
        previous pass (group commit: one pass serves all episodes of the process, 2 ms
        after the first write plus the disk's sync time); record_turn never waits for it
        unless 4 lines of the episode are still pending (a disk that cannot keep up slows
        the loop instead of widening the loss). A finished episode's Parquet files (and
        their directory entries) are fsynced before `finish_episode` returns, and only
        then is its journal deleted.
      - "sync": nothing accepted is lost (fdatasync inside every record_turn).
      - "flush": recent turns and finished episodes may be lost (nothing waits for the
        disk); for bulk imports, tests and benchmarks.
    """

    def __init__(self, root: Path | str, *, durability: Durability = "turn") -> None:
        if durability not in DURABILITIES:
            raise ValueError(
                f"durability must be one of {', '.join(DURABILITIES)}, not {durability!r}"
            )
        self.layout = Layout(root)
        self.durability: Durability = durability
        self.durable_files = durability != "flush"
        self._open: dict[tuple[str, str], _Open] = {}
        self._lock = threading.Lock()

    # ---- Recorder protocol --------------------------------------------------------------
    def start_episode(self, episode: EpisodeRecord) -> None:
        check_run_id(episode.run_id)
        check_episode_id(episode.episode_id)
        key = (episode.run_id, episode.episode_id)
        with self._lock:
            if key in self._open:
                raise RecordError(
                    f"episode {episode.episode_id} of run {episode.run_id} is already open in "
                    "this writer (start_episode called twice without finish_episode)"
                )
            path = self.layout.journal_path(*key)
            if path.exists() and not is_live(path):
                # A previous attempt died mid-episode: keep its turns (as an 'interrupted'
                # episode) before this attempt replaces it, so nothing journaled is lost.
                self._recover_orphan(path)
            self._open[key] = _Open(episode, Journal(path, episode, self.durability))

    def record_turn(self, turn: TurnRecord) -> None:
        state = self._state(turn.run_id, turn.episode_id, "record_turn")
        with state.lock:
            state.journal.append(turn)
            state.turns.append(turn)

    def finish_episode(self, episode: EpisodeRecord) -> None:
        key = (episode.run_id, episode.episode_id)
        with self._lock:
            state = self._open.pop(key, None)
        if state is None:  # an episode without turns may be finished without a start
            commit_episode(self.layout, episode, [], durable=self.durable_files)
            return
        with state.lock:
            try:
                commit_episode(self.layout, episode, state.turns, durable=self.durable_files)
            except BaseException:
                state.journal.close(remove=False)  # keep the journal: recoverable
                raise
            state.journal.close(remove=True)

    # ---- lifecycle -------------------------------------------------------------------
    def abandon(self, run_id: str, episode_id: str) -> None:
        """Stop recording an episode without committing it; its journal stays (orphan)."""
        with self._lock:
            state = self._open.pop((run_id, episode_id), None)
        if state is not None:
            state.journal.close(remove=False)

    def close(self) -> None:
        """Release every open episode's journal (they become orphans: recoverable)."""
        with self._lock:
            states, self._open = list(self._open.values()), {}
        for s in states:
            s.journal.close(remove=False)

    @property
    def open_episodes(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._open)

    # ---- internals ---------------------------------------------------------------------
    def _state(self, run_id: str, episode_id: str, what: str) -> _Open:
        with self._lock:
            state = self._open.get((run_id, episode_id))
        if state is None:
            raise RecordError(
                f"{what}: episode {episode_id!r} of run {run_id!r} was not started in this "
                "writer (call start_episode first)"
            )
        return state

    def _recover_orphan(self, path: Path) -> None:
        recover_journal(self.layout, path)


__all__ = ["EpisodeWriter", "RecordError", "commit_episode", "new_id"]
