"""The warehouse runs `SandboxEnv` writes: held by their process, ended when it ends.

A trainer's process records its env episodes into one warehouse run (rl.env.default_run_id,
or the `run_id` it passes), shared by every env object of the process. Readers tell a live
run from a dead one by the run's lock (warehouse/runlock.py): `running` with the lock free
reads `interrupted` (abandoned). So, as every other writer of a run (engine.run.open_run):

- the process takes the run's lock before the first episode it records and holds it to
  its end: the run reads `running` while the trainer lives;
- a second process writing the same run id is refused (`RunLockedError`, naming the
  holder) before it opens a sandbox or writes anything: sample indices are counted per
  process, so two processes would write the same episode keys;
- when the process ends normally (atexit), or when the trainer calls `finish_runs()`,
  each run is ended through `Warehouse.finish_run` with the engine's statuses:
  `finished`, or `interrupted` naming the episodes left running (or the uncaught
  exception the process ended with), then its lock is released;
- a process killed with kill -9 cannot record anything: the kernel frees its lock, and
  readers show the run `interrupted` (the existing rule).

Per process: an entry inherited through fork() belongs to the parent (the child neither
uses nor ends it; its flock is the parent's).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.plan import RunLockedError
from tasks.records import EpisodeRecord, Recorder, TurnRecord

log = logging.getLogger(__name__)


@dataclass
class _EnvRun:
    """One run this process writes: its lock (held until `_end`) and its open episodes."""

    warehouse: Path
    run_id: str
    held: contextlib.ExitStack
    notes: str | None
    pid: int = field(default_factory=os.getpid)
    live: set[str] = field(default_factory=set)  # episode ids started and not yet finished


_RUNS: dict[tuple[str, str], _EnvRun] = {}
_LOCK = threading.Lock()
_ATEXIT: list[bool] = []  # registered once


def _key(warehouse: Path, run_id: str) -> tuple[str, str]:
    return (str(Path(warehouse).resolve()), run_id)


def _mine(key: tuple[str, str]) -> _EnvRun | None:
    run = _RUNS.get(key)
    return run if run is not None and run.pid == os.getpid() else None


def open_env_run(warehouse: Path, run_id: str, **fields: Any) -> bool:
    """Hold run `run_id` of `warehouse` for this process and record it `running` (once per
    process; later calls return False at once). `fields`: Warehouse.write_run's (model,
    config, notes). Raises RunLockedError, nothing written, when another process holds
    the run. True when this call opened it (the caller then learns what earlier
    processes stored in it: taken_samples)."""
    from warehouse import RunLocked
    from warehouse.store import Warehouse

    key = _key(warehouse, run_id)
    with _LOCK:
        if _mine(key) is not None:
            return False
        wh = Warehouse(warehouse)
        held = contextlib.ExitStack()
        try:
            held.enter_context(wh.hold_run(run_id))
        except RunLocked as exc:
            raise RunLockedError(_refusal(run_id, exc)) from None
        try:
            wh.remove_dead_temps(run_id)  # what a killed writer of the run left half-written
            wh.write_run(run_id, status="running", **fields)
        except BaseException:
            held.close()
            raise
        _RUNS[key] = _EnvRun(Path(warehouse), run_id, held, fields.get("notes"))
        if not _ATEXIT:
            atexit.register(_at_exit)
            _ATEXIT.append(True)
    return True


def taken_samples(warehouse: Path, run_id: str) -> dict[str, int]:
    """{task_id: the highest sample index stored in the run}, episodes and orphan journals
    of earlier processes alike: a process that writes the run again (an explicit run_id,
    one after the other) starts after them, so its episode keys never overwrite theirs."""
    from warehouse.store import Warehouse

    wh = Warehouse(warehouse)
    top: dict[str, int] = {}
    keys: list[tuple[str | None, int | None]] = [
        (t, s) for t, _, s in wh.done_keys(run_id, include_infra=True)
    ]
    keys += [(o.task_id, o.sample_index) for o in wh.orphans(run_id)]
    for task, sample in keys:
        if task is not None and sample is not None:
            top[task] = max(top.get(task, -1), int(sample))
    return top


def _refusal(run_id: str, exc: Any) -> str:
    holder = exc.holder.describe() if exc.holder is not None else "another process"
    return (
        f"run {run_id} is being written by {holder}, and the episodes of two processes "
        "would collide in it (sample indices are counted per process): give each process "
        "its own run_id (the default, rl.env.default_run_id, does)"
    )


def finish_runs(run_id: str | None = None) -> dict[str, str]:
    """End this process's env runs (or the one named `run_id`): each is recorded
    `finished`, or `interrupted` with a note naming the episodes still running, and its
    lock released. Returns {run_id: status}. atexit calls it; a trainer may call it to end
    a run without exiting (close its envs first: an episode still running counts as left).
    An env used afterwards opens its run again (`running`, as a resumed run)."""
    with _LOCK:
        keys = [k for k in _RUNS if (run_id is None or k[1] == run_id) and _mine(k) is not None]
        runs = [_RUNS.pop(k) for k in keys]
    return {run.run_id: _end(run, None) for run in runs}


def _at_exit() -> None:
    """The process ends normally (or by an uncaught exception, which Python has printed:
    `sys.last_value`); a kill -9 never gets here (readers then show `interrupted`)."""
    crash = getattr(sys, "last_value", None)
    with _LOCK:
        runs = [_RUNS.pop(k) for k in list(_RUNS) if _mine(k) is not None]
    for run in runs:
        _end(run, crash)


def _end(run: _EnvRun, crash: BaseException | None) -> str:
    from warehouse.store import Warehouse

    with _LOCK:
        left = len(run.live)
    why = []
    if left:
        why.append(f"{left} episode(s) were still running when the run ended")
    if crash is not None:
        why.append(f"the process ended with an uncaught {type(crash).__name__}")
    status = "interrupted" if why else "finished"
    notes = "; ".join([*([run.notes] if run.notes else []), *why]) or None
    wh = Warehouse(run.warehouse)
    try:
        if wh.layout.run_file(run.run_id).exists():  # a deleted warehouse is not made again
            wh.finish_run(run.run_id, status=status, notes=notes)
    except OSError as exc:  # at exit: say so; the lock is released below (reads `interrupted`)
        log.warning("could not record the end of run %s (%s): %s", run.run_id, status, exc)
    finally:
        run.held.close()
    return status


class TrackedRecorder:
    """A Recorder that keeps the run's count of episodes started and not yet finished
    (those left running when the run ends make it `interrupted`)."""

    def __init__(self, inner: Recorder, warehouse: Path) -> None:
        self.inner = inner
        self._root = _key(warehouse, "")[0]

    def _live(self, episode: EpisodeRecord) -> set[str] | None:
        run = _mine((self._root, episode.run_id))
        return run.live if run is not None else None

    def start_episode(self, episode: EpisodeRecord) -> None:
        self.inner.start_episode(episode)
        with _LOCK:
            live = self._live(episode)
            if live is not None:
                live.add(episode.episode_id)

    def record_turn(self, turn: TurnRecord) -> None:
        self.inner.record_turn(turn)

    def finish_episode(self, episode: EpisodeRecord) -> None:
        self.inner.finish_episode(episode)  # one it failed to commit stays left (its journal)
        with _LOCK:
            live = self._live(episode)
            if live is not None:
                live.discard(episode.episode_id)

    def __getattr__(self, name: str) -> Any:  # close(), abandon() ... of the inner recorder
        return getattr(self.inner, name)
