"""The run flow's end (compaction), the flows' reads through the warehouse, stale scores.

Real Prefect (the session harness), real DuckDB and Parquet files, real HTTP to a
scripted model. LLM mode: no sandbox is needed for what these tests check.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.flows.conftest import ANSWER, new_run_id, run_kwargs, tiny_tasks, write_tasks
from tests.scripted_model import Fault, Reply, ScriptedModel, text_reply

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _thread_runner(n: int = 2) -> Any:
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=n)


def _query(wh: Path, sql: str) -> list[tuple[Any, ...]]:
    from warehouse.query import connect

    with connect(wh) as q:
        return q.rows(sql)


def _files(wh: Path, table: str, rid: str) -> list[str]:
    return sorted(p.name for p in (wh / table / f"run_id={rid}").glob("*.parquet"))


def _run(ts: Path, server: ScriptedModel, wh: Path, rid: str, **kw: Any) -> dict[str, Any]:
    from flows.run import run_flow

    kw.setdefault("mode", "llm")
    kw.setdefault("retries", 0)
    return run_flow.with_options(task_runner=_thread_runner())(**run_kwargs(ts, server, wh, run_id=rid, **kw))


def _text(body: dict) -> str:
    return " ".join(str(m.get("content")) for m in body.get("messages", []))


def test_run_compacts_at_its_end_and_resume_keeps_one_row_per_key(tmp_path: Path) -> None:
    """Run 1 leaves t1 as model_error and compacts; the resume re-runs t1, whose new files sit
    beside the compacted ones (latest attempt wins); the next run's compaction merges them."""
    from warehouse import Warehouse

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(3))
    wh = tmp_path / "wh"
    rid = new_run_id("compact")
    broken = {"t1": True}

    def answer(body: dict, index: int) -> Reply | Fault:
        if "Task t1" in _text(body) and broken["t1"]:
            return Fault.server_error(400)  # not retried by the client: model_error
        return text_reply(ANSWER)

    with ScriptedModel(default=answer, models=("scripted",)) as server:
        first = _run(ts, server, wh, rid)
        assert first["succeeded"] == 2 and first["failed"] == 1, first
        comp = first["compaction"]
        assert comp["files_before"]["episodes"] == 3 and comp["rows_after"]["episodes"] == 3, comp
        assert comp["seconds"] >= 0 and "error" not in comp
        for table in ("episodes", "turns"):
            (name,) = _files(wh, table, rid)
            assert name.startswith("compacted-")
        assert len(Warehouse(wh).done_keys(rid)) == 2  # resume reads the compacted file

        broken["t1"] = False
        second = _run(ts, server, wh, rid, compact=False)
        assert second["skipped"] == 2 and second["ran"] == 1 and second["succeeded"] == 1
        assert second["compaction"] is None
        names = _files(wh, "episodes", rid)
        assert len(names) == 2 and sum(n.startswith("compacted-") for n in names) == 1, names
        # One row per key; t1's latest attempt (submitted) wins over its compacted model_error.
        assert _query(wh, f"SELECT count(*) FROM _raw_episodes WHERE run_id = '{rid}'") == [(4,)]
        terms = dict(_query(wh, f"SELECT task_id, termination FROM episodes WHERE run_id = '{rid}'"))
        assert terms == {"t0": "submitted", "t1": "submitted", "t2": "submitted"}
        data = Warehouse(wh).load_run(rid)
        assert len(data.episodes) == 3 and {e.termination for e in data.episodes} == {"submitted"}
        t1 = next(e for e in data.episodes if e.task_id == "t1")
        assert f"{t1.episode_id}.{data.attempts[t1.episode_id]}.parquet" in _files(wh, "turns", rid)
        assert [t.turn_index for t in data.turns_of(t1.episode_id)] == [0]
        assert data.turns_of(t1.episode_id)[0].assistant_content == ANSWER

        third = _run(ts, server, wh, rid)  # nothing left to run; its end compacts again
        assert third["ran"] == 0 and third["compaction"]["files_before"]["episodes"] == 2
    for table in ("episodes", "turns"):
        (name,) = _files(wh, table, rid)
        assert name.startswith("compacted-")
    assert _query(wh, f"SELECT count(*) FROM _raw_episodes WHERE run_id = '{rid}'") == [(3,)]
    assert Warehouse(wh).load_run(rid).turns_of(t1.episode_id)[0].assistant_content == ANSWER


def test_run_end_compaction_with_a_reader_open(tmp_path: Path) -> None:
    """A query session open while the run ends keeps its snapshot; the merged files are
    deleted once it closes (the flow waits briefly), or reported as pending if it stays."""
    import threading
    import time

    from warehouse.query import connect

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(2))
    wh = tmp_path / "wh"
    wh.mkdir()
    with ScriptedModel(default=text_reply(ANSWER), models=("scripted",)) as server:
        rid = new_run_id("reader")
        _run(ts, server, wh, rid, compact=False)
        q = connect(wh, run_id=rid)  # a reader that closes once the compaction has switched
        before = q.rows("SELECT episode_id, write_id FROM episodes ORDER BY 1")
        manifest = wh / "turns" / f"run_id={rid}" / "_compaction.json"

        def close_after_switch() -> None:
            deadline = time.monotonic() + 60
            while not manifest.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            q.close()

        closer = threading.Thread(target=close_after_switch)
        closer.start()
        summary = _run(ts, server, wh, rid)
        closer.join()
        assert summary["compaction"]["files_before"]["episodes"] == 2
        assert summary["compaction"]["pending_deletes"] == 0, summary["compaction"]
        assert [n.startswith("compacted-") for n in _files(wh, "episodes", rid)] == [True]

        rid2 = new_run_id("reader2")
        _run(ts, server, wh, rid2, compact=False)
        with connect(wh, run_id=rid2) as held:  # open for the whole run end
            summary = _run(ts, server, wh, rid2)
            assert summary["compaction"]["pending_deletes"] == 4  # 2 episode + 2 turns files
            assert held.rows("SELECT count(*) FROM turns") == [(2,)]  # its snapshot reads on
        assert before and _query(wh, f"SELECT count(*) FROM episodes WHERE run_id = '{rid2}'") == [(2,)]
    from warehouse import Warehouse

    assert Warehouse(wh).compact(rid2).pending_deletes == 0  # `sandflow warehouse compact` later
    assert [n.startswith("compacted-") for n in _files(wh, "turns", rid2)] == [True]


def test_a_rerecorded_episode_loses_its_stale_score_until_scored_again(tmp_path: Path) -> None:
    from engine.episode import run_one
    from engine.plan import plan
    from flows.score import score_flow
    from tasks.spec import RunSpec
    from warehouse import Warehouse

    tasks = tiny_tasks(2)
    ts = write_tasks(tmp_path / "tiny.parquet", tasks)
    wh = tmp_path / "wh"
    rid = new_run_id("stale")
    reply = {"text": ANSWER}
    with ScriptedModel(default=lambda body, i: text_reply(reply["text"]), models=("scripted",)) as server:
        _run(ts, server, wh, rid)
        first = score_flow(run_id=rid, warehouse=str(wh))
        assert first["scored"] == 2 and first["mean_score"] == 1.0
        data = Warehouse(wh).load_run(rid)
        assert {e: s.score for e, s in data.scores.items()} == {e.episode_id: 1.0 for e in data.episodes}
        # Re-record t0's episode (same key, new attempt) with a wrong answer.
        reply["text"] = "41"
        spec = next(s for s in plan(tasks, rid, "llm", 1) if s.task.id == "t0")
        settings = RunSpec(
            model="scripted",
            base_url=server.url,
            max_steps=3,
            warehouse=str(wh),
        )
        assert run_one(spec, settings).termination == "submitted"
    data = Warehouse(wh).load_run(rid)
    assert spec.key not in data.scores and len(data.scores) == 1  # the old 1.0 is stale
    assert _query(wh, f"SELECT episode_id FROM stale_scores WHERE run_id = '{rid}'") == [(spec.key,)]
    assert _query(wh, f"SELECT episodes, scored FROM accuracy WHERE run_id = '{rid}'") == [(2, 1)]

    second = score_flow(run_id=rid, warehouse=str(wh))  # scores the current attempts
    assert second["scored"] == 2 and second["mean_score"] == 0.5
    data = Warehouse(wh).load_run(rid)
    assert data.scores[spec.key].score == 0.0  # the new answer was judged, not the old one
    assert _query(wh, f"SELECT episode_write_id = '{data.attempts[spec.key]}' FROM scores "
                      f"WHERE episode_id = '{spec.key}'") == [(True,)]  # fmt: skip
    assert _query(wh, f"SELECT count(*) FROM stale_scores WHERE run_id = '{rid}'") == [(0,)]


def test_flows_skip_a_bad_file_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from flows.score import score_flow
    from warehouse import Warehouse

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(2))
    wh = tmp_path / "wh"
    rid = new_run_id("badfile")
    with ScriptedModel(default=text_reply(ANSWER), models=("scripted",)) as server:
        _run(ts, server, wh, rid, compact=False)
    bad = wh / "episodes" / f"run_id={rid}" / "half-written.parquet"
    bad.write_bytes(b"PAR1" + b"\x00" * 40)  # no closing magic bytes: truncated
    with caplog.at_level(logging.WARNING):
        data = Warehouse(wh).load_run(rid)
    assert len(data.episodes) == 2 and all(len(data.turns_of(e.episode_id)) == 1 for e in data.episodes)
    assert len(data.skipped_files) == 1 and str(bad) in data.skipped_files[0]
    assert str(bad) in caplog.text
    assert len(Warehouse(wh).done_keys(rid)) == 2
    summary = score_flow(run_id=rid, warehouse=str(wh))
    assert summary["scored"] == 2 and str(bad) in summary["skipped_files"][0]


def test_store_errors_name_the_problem(tmp_path: Path) -> None:
    from warehouse import Warehouse
    from warehouse import WarehouseError as StoreError

    with pytest.raises(StoreError, match="does not exist"):
        Warehouse(tmp_path / "nowhere").load_run("r1")
    (tmp_path / "wh").mkdir()
    with pytest.raises(StoreError, match="has no episodes"):
        Warehouse(tmp_path / "wh").load_run("r1")
    with pytest.raises(StoreError, match="invalid run_id"):
        Warehouse(tmp_path / "wh").load_run("../etc")
