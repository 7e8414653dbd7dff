"""A run's episodes streamed out of the warehouse, a batch at a time.

Why batches: the exporters must handle a run of 100,000 episodes without holding it in
memory. One query session lists the run's episode ids (a few MB even then), then reads
episodes, turns and current scores for `batch` ids at a time; at most one batch of
records is alive at once. The warehouse's own views decide what an episode is (latest
attempt, its turns, non-stale scores), exactly as `Warehouse.load_run` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.records import EpisodeRecord, TurnRecord
from warehouse import Warehouse
from warehouse.convert import episode_record, turn_record
from warehouse.query import RunNotFound, WarehouseError, WarehouseQuery
from warehouse.rundata import Score, latest_scores

BATCH = 256  # episodes per read (module-level so a benchmark or test can change it)


def batch_size() -> int:
    """BATCH as it is now (looked up at call time, not bound at import)."""
    return BATCH


@dataclass
class Episode:
    """One episode as the exporters see it: its record, its turns, its current score."""

    record: EpisodeRecord
    turns: list[TurnRecord]
    score: Score | None
    write_id: str
    row: dict[str, Any]  # the raw `episodes` row (fields EpisodeRecord leaves out)
    ground_truth: str | None = None  # as the score row recorded it (None: not scored)


def quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


class RunSource:
    """The episodes of one run. Use as a context manager; iterate with `episodes()`."""

    def __init__(self, root: Path | str, run_id: str) -> None:
        self.wh = Warehouse(root)
        self.run_id = run_id
        try:
            self.q: WarehouseQuery = self.wh.query(
                run_id=run_id, tables=("runs", "episodes", "turns", "scores")
            )
        except ValueError as exc:  # an invalid run id: the message names it
            raise WarehouseError(str(exc)) from None
        runs = self._rows("SELECT * FROM runs")
        self.info: dict[str, Any] = runs[0] if runs else {"run_id": run_id}
        self.skipped_files = [str(b) for b in self.q.snapshot.bad]

    def __enter__(self) -> RunSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.q.close()

    def ids(self, *, mode: str | None = None, episode_id: str | None = None) -> list[str]:
        """Episode ids in a stable order (mode, task, sample), optionally of one mode/id."""
        where = []
        if mode is not None:
            where.append(f"mode = {quote(mode)}")
        if episode_id is not None:
            where.append(f"episode_id = {quote(episode_id)}")
        sql = "SELECT episode_id FROM episodes" + (f" WHERE {' AND '.join(where)}" if where else "")
        rows = self.q.rows(sql + " ORDER BY mode, task_id, sample_index, episode_id")
        return [r[0] for r in rows]

    def require(self) -> None:
        """Raise RunNotFound (naming recent runs) when the run has no episodes."""
        if not self.q.rows("SELECT 1 FROM episodes LIMIT 1"):
            known = ", ".join(self.wh.run_ids()[-5:]) or "none"
            raise RunNotFound(
                f"run {self.run_id!r} has no episodes in warehouse {self.wh.root} (recent runs: {known})"
            )

    def modes(self) -> list[str]:
        return [r[0] for r in self.q.rows("SELECT DISTINCT mode FROM episodes ORDER BY mode")]

    def episodes(self, ids: list[str], *, batch: int | None = None, with_turns: bool = True) -> Iterator[Episode]:
        """The episodes `ids`, in that order, read `batch` (default BATCH) at a time."""
        batch = batch or batch_size()
        for start in range(0, len(ids), batch):
            chunk = ids[start : start + batch]
            inlist = ", ".join(quote(i) for i in chunk)
            eps = {r["episode_id"]: r for r in self._rows(f"SELECT * FROM episodes WHERE episode_id IN ({inlist})")}
            turns: dict[str, list[TurnRecord]] = {}
            if with_turns:
                sql = f"SELECT * FROM turns WHERE episode_id IN ({inlist}) ORDER BY episode_id, turn_index"
                for r in self._rows(sql):
                    turns.setdefault(r["episode_id"], []).append(turn_record(r))
            score_rows = self._rows(f"SELECT * FROM scores WHERE episode_id IN ({inlist})")
            scores = latest_scores(score_rows)
            truths = _ground_truths(score_rows, scores)
            for eid in chunk:
                row = eps.get(eid)
                if row is None:  # vanished between the listing and the read
                    continue
                yield Episode(
                    record=episode_record(row),
                    turns=turns.get(eid, []),
                    score=scores.get(eid),
                    write_id=row["write_id"],
                    row=row,
                    ground_truth=truths.get(eid),
                )

    def _rows(self, sql: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for b in self.q.arrow(sql).to_batches():
            out.extend(b.to_pylist())
        return out


def _ground_truths(rows: list[dict[str, Any]], scores: dict[str, Score]) -> dict[str, str | None]:
    """episode_id -> the ground truth recorded with its current score (the same row)."""
    best: dict[str, tuple[str, str | None]] = {}
    for r in rows:
        s = scores.get(r["episode_id"])
        if s is None or r["verifier"] != s.verifier or r["score"] is None:
            continue
        if r["episode_id"] not in best or str(r["batch_id"]) > best[r["episode_id"]][0]:
            best[r["episode_id"]] = (str(r["batch_id"]), r.get("ground_truth"))
    return {k: v for k, (_b, v) in best.items()}
