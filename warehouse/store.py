"""`Warehouse`: the one object the rest of sandflow talks to.

It ties the parts together (writer, journals, runs, labels, compaction, queries) behind
methods named for what callers need: record episodes, ask which keys are done, write
scores and usage labels, read episodes and turns back, compact, query.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from datasets_prep.task import Task, TaskSet
from tasks.records import INFRA_TERMINATIONS, EpisodeRecord, TurnRecord, episode_key
from warehouse.compact import CompactionResult, compact_run
from warehouse.convert import episode_record, turn_record
from warehouse.dataitems import claim_build, write_data_items
from warehouse.journal import Durability
from warehouse.labels import ScoreRow, UsageRow, write_labels
from warehouse.layout import Layout
from warehouse.query import RunNotFound, WarehouseError, WarehouseNotFound, WarehouseQuery
from warehouse.recovery import Orphan, find_orphans, recover_orphans
from warehouse.rundata import RunData, latest_scores
from warehouse.runs import finish_run, read_run, write_run
from warehouse.schema import check_run_id
from warehouse.series import MAX_TURNS, SeriesData, read_series, read_trajectories
from warehouse.tasksets import adhoc_task, keep_adhoc_task, keep_tasks, run_tasks, unlike_tasks
from warehouse.trainsteps import write_train_steps
from warehouse.writer import EpisodeWriter

log = logging.getLogger(__name__)


class Warehouse:
    """The warehouse at `root` (the application resolves it: --warehouse, SANDFLOW_WAREHOUSE,
    sandflow.toml, else DEFAULT_ROOT; this library never reads settings itself)."""

    def __init__(self, root: Path | str) -> None:
        self.layout = Layout(root)

    @property
    def root(self) -> Path:
        return self.layout.root

    # ---- writing ---------------------------------------------------------------------
    def writer(self, *, durability: Durability = "turn") -> EpisodeWriter:
        """A Recorder for the agent loop (thread-safe; one per process is enough)."""
        return EpisodeWriter(self.root, durability=durability)

    def write_run(self, run_id: str, **fields: Any) -> dict[str, Any]:
        """Start (or re-describe) a run: model, image, dataset, dataset_hash, config, notes."""
        return write_run(self.layout, run_id, **fields)

    def finish_run(self, run_id: str, **fields: Any) -> dict[str, Any]:
        return finish_run(self.layout, run_id, **fields)

    def run_info(self, run_id: str) -> dict[str, Any] | None:
        """The run's row as readers see it: one recorded `running` whose process died
        (its lock free, warehouse/runlock.is_held) reads as interrupted, as in the
        ``runs`` view."""
        from warehouse.runlock import ABANDONED_NOTE, is_held

        row = read_run(self.layout, run_id)
        if row is not None and row.get("status") == "running" and is_held(self.layout, run_id) is False:
            notes = "; ".join(n for n in (row.get("notes"), ABANDONED_NOTE) if n)
            row = {**row, "status": "interrupted", "notes": notes}
        return row

    # ---- the tasks a run ran (warehouse.tasksets) --------------------------------------
    def keep_tasks(self, run_id: str, tasks: Iterable[Task], *, name: str = "tasks") -> int:
        """Record tasks `run_id` runs (those this process has not recorded yet)."""
        return keep_tasks(self.layout, run_id, tasks, name=name)

    def run_tasks(self, run_id: str) -> TaskSet | None:
        """The exact tasks `run_id` ran (None when it recorded none)."""
        return run_tasks(self.layout, run_id)

    def keep_adhoc_task(self, run_id: str, task: Task) -> Path:
        """Keep a task without ground truth (`sandflow run`'s query): a replay reads it."""
        return keep_adhoc_task(self.layout, run_id, task)

    def adhoc_task(self, run_id: str, task_id: str) -> Task | None:
        return adhoc_task(self.layout, run_id, task_id)

    def unlike_tasks(self, run_a: str, run_b: str) -> str | None:
        """Why two runs cannot be paired task by task (one sentence), or None."""
        runs = {r: read_run(self.layout, r) or {} for r in (run_a, run_b)}
        return unlike_tasks(self.layout, run_a, run_b, runs)

    def write_id_of(self, run_id: str, episode_id: str) -> str | None:
        """The recording attempt `episode_id`'s row names now (`episode_write_id` of a score
        made right after it was recorded); None when its own file is not there (not
        committed, or compacted into the run's file: the `scores` view then judges by time)."""
        import pyarrow.parquet as pq

        try:
            ids = pq.read_table(self.layout.episode_file(run_id, episode_id), columns=["write_id"])
        except (OSError, pa.ArrowException):
            return None
        found = ids.column("write_id").to_pylist()
        return str(found[0]) if len(found) == 1 and found[0] else None

    def write_scores(
        self, rows: Iterable[ScoreRow | Mapping[str, Any]], *, scored_at: datetime | None = None
    ) -> Path | None:
        return write_labels(self.layout, "scores", rows, scored_at)

    def claim_build(self, build_id: str, output: Path, *, moved: bool = False) -> None:
        """Bind a data build's id to its output folder (warehouse.dataitems.claim_build)."""
        claim_build(self.layout, build_id, output, moved=moved)

    def write_data_items(
        self, build_id: str, stage: str, items: Iterable[Mapping[str, Any]], *, stage_key: str | None = None
    ) -> Path:
        """One stage execution of an RL data build (warehouse.dataitems)."""
        return write_data_items(self.layout, build_id, stage, items, stage_key=stage_key)

    def write_train_steps(self, run_id: str, rows: Iterable[Mapping[str, Any]]) -> Path:
        """Optimizer steps of a training run (warehouse.trainsteps; `training_steps`)."""
        return write_train_steps(self.layout, run_id, rows)

    def write_usage(
        self, rows: Iterable[UsageRow | Mapping[str, Any]], *, labeled_at: datetime | None = None
    ) -> Path | None:
        return write_labels(self.layout, "usage", rows, labeled_at)

    # ---- resume ----------------------------------------------------------------------
    def _has_episode_files(self, run_id: str) -> bool:
        """False for a new run: nothing to read, so no query session (~0.1 s) is opened."""
        return self.root.is_dir() and bool(self.layout.partition_listing("episodes", run_id))

    def done_episode_ids(self, run_id: str, *, include_infra: bool = False) -> set[str]:
        """Episode ids of `run_id` that are committed. Infra failures (model_error,
        sandbox_error, interrupted) are not done unless include_infra: resume re-runs them."""
        check_run_id(run_id)
        if not self._has_episode_files(run_id):
            return set()
        with self.query(run_id=run_id, tables=("episodes",)) as q:
            rows = q.rows("SELECT episode_id, termination FROM episodes")
        return {eid for eid, term in rows if _done(term, include_infra)}

    def done_keys(self, run_id: str, *, include_infra: bool = False) -> set[tuple[str, str, int]]:
        """(task_id, mode, sample_index) of the done episodes of `run_id` (see done_episode_ids).

        Keys are checked against `episode_key` so a row written under a foreign id does not
        count as done.
        """
        check_run_id(run_id)
        if not self._has_episode_files(run_id):
            return set()
        with self.query(run_id=run_id, tables=("episodes",)) as q:
            rows = q.rows(
                "SELECT episode_id, task_id, mode, sample_index, termination FROM episodes"
            )
        return {
            (task, mode, int(sample))
            for eid, task, mode, sample, term in rows
            if _done(term, include_infra) and episode_key(run_id, task, mode, int(sample)) == eid
        }

    def orphans(self, run_id: str | None = None) -> list[Orphan]:
        """Episodes whose writer died mid-way (journal left, nobody holding it)."""
        return find_orphans(self.layout, run_id)

    def recover(
        self, run_id: str | None = None, action: Literal["recover", "discard"] = "recover"
    ) -> list[Orphan]:
        """Commit orphans as termination='interrupted' (or discard them)."""
        return recover_orphans(self.layout, run_id, action)

    def hold_run(self, run_id: str, *, wait: bool | float = False) -> Any:
        """The run's lock (warehouse/runlock.py): one writing process per run id. A context
        manager; raises RunLocked naming the holder when another process has it."""
        from warehouse.runlock import hold_run

        return hold_run(self.layout, check_run_id(run_id), wait=wait)

    def remove_dead_temps(self, run_id: str) -> list[Path]:
        """Delete what writers of `run_id` killed mid-write left (call under the run's lock)."""
        from warehouse.compact import remove_dead_temps

        return remove_dead_temps(self.layout, check_run_id(run_id))

    # ---- maintenance -----------------------------------------------------------------
    def compact(self, run_id: str, *, settle_s: float = 0.0, **kwargs: Any) -> CompactionResult:
        """Merge the run's files into one per table (atomic, idempotent).

        settle_s: a query session open right now keeps the merged inputs on disk, hidden;
        wait up to this long for it to close and delete them then, so a finished run does
        not keep two copies of its data until someone compacts it again.
        """
        res = compact_run(self.layout, check_run_id(run_id), **kwargs)
        deadline = time.monotonic() + settle_s
        while res.pending_deletes and time.monotonic() < deadline:
            time.sleep(0.2)
            if self.layout.readers_idle():
                res.pending_deletes = compact_run(self.layout, run_id, **kwargs).pending_deletes
        return res

    def run_ids(self) -> list[str]:
        return self.layout.run_ids()

    # ---- reading ---------------------------------------------------------------------
    def load_run(
        self, run_id: str, *, verifier: str | None = None, with_turns: bool = True
    ) -> RunData:
        """One run's current episodes, their turns and current scores, from one snapshot.

        The latest recording attempt of an episode wins (its turns are that attempt's);
        a bad file is left out with a warning naming it (`RunData.skipped_files`); scores
        are the newest batch per (episode, verifier), stale ones (of an attempt since
        re-recorded) left out. Raises WarehouseError subclasses that say what to do.
        """
        if not self.root.exists():
            raise WarehouseNotFound(
                f"warehouse root {self.root} does not exist (set --warehouse or SANDFLOW_WAREHOUSE)"
            )
        tables = ("episodes", "turns", "scores") if with_turns else ("episodes", "scores")
        with self._session(run_id, tables) as q:
            eps = _rows(q, "SELECT * FROM episodes")
            if not eps:
                known = ", ".join(self.run_ids()[-5:]) or "none"
                raise RunNotFound(
                    f"run {run_id!r} has no episodes in warehouse {self.root} (recent runs: {known})"
                )
            data = RunData(
                run_id=run_id,
                episodes=[episode_record(r) for r in eps],
                attempts={r["episode_id"]: r["write_id"] for r in eps},
                skipped_files=[str(b) for b in q.snapshot.bad],
            )
            data.episodes.sort(key=lambda e: (e.domain, e.task_id, e.mode, e.sample_index))
            if with_turns:
                for r in _rows(q, "SELECT * FROM turns ORDER BY episode_id, turn_index"):
                    data.turns.setdefault(r["episode_id"], []).append(turn_record(r))
            data.scores = latest_scores(_rows(q, "SELECT * FROM scores"), verifier)
        if data.skipped_files:
            log.warning(
                "run %s: %d bad file(s) left out: %s",
                run_id,
                len(data.skipped_files),
                "; ".join(data.skipped_files[:5]),
            )
        return data

    def series(self, run_id: str, *, last: int = 14) -> SeriesData:
        """The run's nightly series up to the run itself (warehouse.series.read_series)."""
        return read_series(self.root, run_id, last=last)

    def trajectories(
        self, wanted: dict[str, list[str]], *, max_turns: int = MAX_TURNS
    ) -> dict[tuple[str, str], dict[str, Any]]:
        """(run_id, episode_id) -> episode row with its first turns (warehouse.series)."""
        return read_trajectories(self.root, wanted, max_turns=max_turns)

    def episode(self, run_id: str, episode_id: str) -> tuple[EpisodeRecord, list[TurnRecord]] | None:
        """One episode's current attempt and its turns (in order), as records; None when the
        warehouse has no such episode. A replay or a fork reads its parent this way."""
        check_run_id(run_id)
        if not _EPISODE_ID_RE.match(episode_id):
            raise WarehouseError(
                f"invalid episode id {episode_id[:80]!r}: use 1-128 characters from A-Z a-z 0-9 . _ -"
            )
        where = f"episode_id = '{episode_id}'"
        eps = self.episodes(run_id, where).to_pylist()
        if not eps:
            return None
        turns = [turn_record(r) for r in self.turns(run_id, where).to_pylist()]
        return episode_record(eps[0]), turns

    def _session(self, run_id: str, tables: tuple[str, ...]) -> WarehouseQuery:
        """A query session on one run's files; an invalid run id becomes a WarehouseError."""
        try:
            return self.query(run_id=run_id, tables=tables)
        except ValueError as exc:  # an invalid run id (it names it)
            raise WarehouseError(str(exc)) from None

    def query(
        self, *, run_id: str | None = None, quarantine: bool = False, **kw: Any
    ) -> WarehouseQuery:
        """An in-memory DuckDB connection with the views (see warehouse.query)."""
        return WarehouseQuery(self.root, run_id=run_id, quarantine=quarantine, **kw)

    def episodes(self, run_id: str | None = None, where: str | None = None) -> pa.Table:
        """The current episodes (latest attempt each) as an Arrow table."""
        return self._read("episodes", run_id, where, "episode_id")

    def turns(self, run_id: str | None = None, where: str | None = None) -> pa.Table:
        """The current attempts' turns as an Arrow table, ordered by episode and turn."""
        return self._read("turns", run_id, where, "episode_id, turn_index")

    def scores(self, run_id: str | None = None, where: str | None = None) -> pa.Table:
        return self._read("scores", run_id, where, "episode_id, verifier")

    def usage(self, run_id: str | None = None, where: str | None = None) -> pa.Table:
        return self._read("usage", run_id, where, "episode_id, turn_index, call_index")

    def _read(self, view: str, run_id: str | None, where: str | None, order: str) -> pa.Table:
        if run_id is not None:
            check_run_id(run_id)
        if not self.root.is_dir():
            from warehouse.schema import empty_table

            return empty_table(view)
        need = ("episodes", "turns") if view == "turns" else (view, "episodes")
        with self.query(run_id=run_id, tables=need) as q:
            sql = (
                f"SELECT * FROM {view}"
                + (f" WHERE {where}" if where else "")
                + f" ORDER BY {order}"
            )
            return q.arrow(sql)


_EPISODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _done(termination: str | None, include_infra: bool) -> bool:
    """An episode ended with the model's own result; infra failures only when asked."""
    return termination is not None and (include_infra or termination not in INFRA_TERMINATIONS)


def _rows(q: WarehouseQuery, sql: str) -> list[dict[str, Any]]:
    table = q.arrow(sql)
    out: list[dict[str, Any]] = []
    for batch in table.to_batches():  # batch by batch: no second full copy of the run
        out.extend(batch.to_pylist())
    return out
