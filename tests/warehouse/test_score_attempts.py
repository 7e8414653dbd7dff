"""Scores name the attempt they judged; a score of a re-recorded episode is stale.

Real files, real DuckDB: record, score, re-record, then read the views.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq

from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse
from warehouse.convert import now_utc
from warehouse.schema import file_metadata


def _episode_attempts(wh: Warehouse, run: str) -> dict[str, str]:
    with wh.query(run_id=run) as q:
        return dict(q.rows("SELECT episode_id, write_id FROM episodes"))


def _fill(wh: Warehouse, run: str, n: int = 3) -> dict[str, str]:
    with wh.writer(durability="flush") as w:
        for k in range(n):
            ep, turns = make_episode(run, f"t{k}", turns=2)
            record(w, ep, turns)
    return _episode_attempts(wh, run)


def _score_all(wh: Warehouse, run: str, *, with_attempt: bool = True, **kw: object) -> None:
    wh.write_scores(
        [
            {
                "run_id": run,
                "episode_id": eid,
                "verifier": "exact",
                "score": 1.0,
                "episode_write_id": wid if with_attempt else None,
            }
            for eid, wid in _episode_attempts(wh, run).items()
        ],
        **kw,  # type: ignore[arg-type]
    )


def _rerecord(wh: Warehouse, run: str, task: str, answer: str = "redo") -> str:
    ep, turns = make_episode(run, task, turns=3, answer=answer)
    with wh.writer(durability="flush") as w:
        record(w, ep, turns)
    return ep.episode_id


def _views(wh: Warehouse, run: str) -> tuple[set[str], set[str], list[tuple]]:
    with wh.query(run_id=run) as q:
        current = {e for (e,) in q.rows("SELECT episode_id FROM scores")}
        stale = {e for (e,) in q.rows("SELECT episode_id FROM stale_scores")}
        acc = q.rows("SELECT episodes, scored, accuracy FROM accuracy")
    return current, stale, acc


def test_score_of_a_rerecorded_episode_is_stale_until_rescored(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    attempts = _fill(wh, "r1")
    _score_all(wh, "r1")
    with wh.query(run_id="r1") as q:
        stored = dict(q.rows("SELECT episode_id, episode_write_id FROM scores"))
    assert stored == attempts  # each score names the attempt it judged
    assert _views(wh, "r1") == (set(attempts), set(), [(3, 3, 1.0)])

    redone = _rerecord(wh, "r1", "t1")
    current, stale, acc = _views(wh, "r1")
    assert current == set(attempts) - {redone} and stale == {redone}
    assert acc == [(3, 2, 1.0)]  # the re-recorded episode counts as unscored, not as right
    assert wh.scores("r1").num_rows == 2  # Warehouse.scores reads the same view
    with wh.query(run_id="r1") as q:
        ((cur, judged),) = q.rows("SELECT current_write_id, episode_write_id FROM stale_scores")
    assert judged == attempts[redone] and cur != judged

    _score_all(wh, "r1")  # the score flow's answer: score again
    assert _views(wh, "r1") == (set(attempts), set(), [(3, 3, 1.0)])


def test_scores_without_an_attempt_are_judged_by_time(tmp_path: Path) -> None:
    """Rows that do not name their attempt: stale if scored before the episode row was written."""
    wh = Warehouse(tmp_path)
    attempts = _fill(wh, "r1")
    _score_all(wh, "r1", with_attempt=False)
    assert _views(wh, "r1")[:2] == (set(attempts), set())
    redone = _rerecord(wh, "r1", "t2")
    assert _views(wh, "r1")[:2] == (set(attempts) - {redone}, {redone})
    # scored (by the clock) after the re-record: current again
    _score_all(wh, "r1", with_attempt=False, scored_at=now_utc() + timedelta(seconds=1))
    assert _views(wh, "r1")[:2] == (set(attempts), set())


def test_an_old_scores_file_without_the_column_still_reads(tmp_path: Path) -> None:
    """A scores file written before `episode_write_id` existed: NULL, judged by time."""
    wh = Warehouse(tmp_path)
    attempts = _fill(wh, "r1", 2)
    _score_all(wh, "r1")
    (batch,) = (tmp_path / "scores" / "run_id=r1").glob("batch-*.parquet")
    old = pq.read_table(batch).drop_columns(["episode_write_id"])
    old = old.replace_schema_metadata(file_metadata("scores", old.column_names))
    pq.write_table(old, batch)
    with wh.query(run_id="r1") as q:
        assert q.snapshot.bad == []
        assert q.rows("SELECT count(*), count(episode_write_id) FROM scores") == [(2, 0)]
    redone = _rerecord(wh, "r1", "t0")
    assert _views(wh, "r1")[:2] == (set(attempts) - {redone}, {redone})


def test_staleness_survives_compaction(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    attempts = _fill(wh, "r1", 4)
    _score_all(wh, "r1")
    redone = _rerecord(wh, "r1", "t3")
    before = _views(wh, "r1")
    wh.compact("r1")
    for table in ("episodes", "scores"):
        names = [p.name for p in (tmp_path / table / "run_id=r1").glob("*.parquet")]
        assert len(names) == 1 and names[0].startswith("compacted-"), names
    assert _views(wh, "r1") == before
    assert before[1] == {redone} and len(attempts) == 4
