"""Episode lineage (issue #25): parent, branch turn and kind stored once, read back, and
the `episode_tree` view (root, parent, depth, children) over real Parquet and DuckDB.

Files written before the lineage columns existed still read: their episodes are roots."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse
from warehouse.convert import episode_record

LINEAGE = ("parent_run_id", "parent_episode_id", "branch_turn", "branch_kind")


def _child(run_id: str, task: str, parent, *, turn: int, kind: str, sample: int = 0):
    ep, ts = make_episode(run_id, task, sample=sample, turns=turn + 1)
    ep = ep.model_copy(update={
        "parent_run_id": parent.run_id, "parent_episode_id": parent.episode_id,
        "branch_turn": turn, "branch_kind": kind,
    })  # fmt: skip
    return ep, ts


def test_lineage_round_trip_and_episode_tree(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    root, rts = make_episode("r1", "t1", turns=4)
    fork_a, fa = _child("r1", "t1", root, turn=2, kind="fork", sample=1)
    fork_b, fb = _child("r1", "t1", root, turn=2, kind="fork", sample=2)
    replay, rp = _child("r2", "t1", fork_a, turn=3, kind="replay")  # another run
    orphan, orp = make_episode("r3", "t9", turns=1)
    orphan = orphan.model_copy(update={"parent_run_id": "gone", "parent_episode_id": "e404",
                                       "branch_turn": 1, "branch_kind": "replay"})
    with wh.writer(durability="flush") as w:
        for ep, ts in ((root, rts), (fork_a, fa), (fork_b, fb), (replay, rp), (orphan, orp)):
            record(w, ep, ts)

    # the Parquet columns, and back into the record
    (path,) = (tmp_path / "episodes" / "run_id=r2").glob("*.parquet")
    row = pq.read_table(path).to_pylist()[0]
    assert [row[c] for c in LINEAGE] == ["r1", fork_a.episode_id, 3, "replay"]
    with wh.query() as q:
        (back,) = q.arrow("SELECT * FROM episodes WHERE run_id = 'r2'").to_pylist()
    rec = episode_record(back)
    assert (rec.parent_run_id, rec.parent_episode_id, rec.branch_turn, rec.branch_kind) == (
        "r1", fork_a.episode_id, 3, "replay")

    with wh.query() as q:
        rows = q.rows(
            "SELECT run_id, episode_id, root_run_id, root_episode_id, parent_episode_id, depth, "
            "branch_turn, branch_kind, children FROM episode_tree ORDER BY depth, run_id, episode_id"
        )
    got = {(r[0], r[1]): r[2:] for r in rows}
    rid = (root.run_id, root.episode_id)
    assert got[rid] == (*rid, None, 0, None, None, 2)
    assert got[("r1", fork_a.episode_id)] == (*rid, root.episode_id, 1, 2, "fork", 1)
    assert got[("r1", fork_b.episode_id)] == (*rid, root.episode_id, 1, 2, "fork", 0)
    assert got[("r2", replay.episode_id)] == (*rid, fork_a.episode_id, 2, 3, "replay", 0)
    # a parent not in the warehouse: a root of its own, still naming its parent
    assert got[("r3", orphan.episode_id)] == ("r3", orphan.episode_id, "e404", 0, 1, "replay", 0)
    assert len(rows) == 5


def test_files_without_the_lineage_columns_still_read(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    with wh.writer(durability="flush") as w:
        ep, ts = make_episode("old", "t1", turns=2)
        record(w, ep, ts)
    (path,) = (tmp_path / "episodes" / "run_id=old").glob("*.parquet")
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    names = [n for n in table.column_names if n not in LINEAGE]
    old = table.select(names)
    meta[b"sandflow.columns"] = ",".join(names).encode()
    pq.write_table(old.replace_schema_metadata(meta), path)  # as an older sandflow wrote it
    assert not set(LINEAGE) & set(pq.read_schema(path).names)

    with wh.query() as q:
        (row,) = q.arrow("SELECT * FROM episodes").to_pylist()
        tree = q.rows("SELECT root_episode_id, parent_episode_id, depth, branch_kind FROM episode_tree")
    assert [row[c] for c in LINEAGE] == [None] * 4
    assert episode_record(row).branch_kind is None
    assert tree == [(ep.episode_id, None, 0, None)]


def test_an_adhoc_task_is_kept_for_a_replay_and_an_edit_is_named(tmp_path: Path) -> None:
    """`sandflow run`'s query (no ground truth) is no task-set task; a replay still needs its
    files: kept beside the task sets, read back whole, refused once edited."""
    import json

    import pytest

    from datasets_prep.task import make_task
    from warehouse import RunTasksError

    task = make_task({"id": "adhoc-1", "domain": "general", "problem_statement": "Count them.",
                      "ground_truth": None, "input_files": {"a.txt": "1 2\n", "b.bin": b"\x00\xff"}},
                     "test", adhoc=True)  # fmt: skip
    wh = Warehouse(tmp_path)
    path = wh.keep_adhoc_task("r1", task)
    assert wh.keep_adhoc_task("r1", task) == path  # idempotent
    back = wh.adhoc_task("r1", "adhoc-1")
    assert back is not None and back.content_hash == task.content_hash and back.input_files["b.bin"] == b"\x00\xff"
    assert wh.adhoc_task("r1", "other") is None and wh.run_tasks("r1") is None  # not a task set
    obj = json.loads(path.read_text())
    obj["task"]["input_files"]["a.txt"] = "9 9\n"
    path.write_text(json.dumps(obj))
    with pytest.raises(RunTasksError, match="content hash mismatch: the file was edited"):
        wh.adhoc_task("r1", "adhoc-1")
