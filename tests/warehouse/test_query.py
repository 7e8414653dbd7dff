"""Views over real Parquet with real DuckDB: ready-made answers, bad input, schema evolution."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse, WarehouseNotFound, WarehouseQueryError
from warehouse.query import VIEW_HELP


def _populate(root: Path) -> Warehouse:
    """2 domains x 2 modes, scored, usage-labelled, one time-out and one infra failure."""
    wh = Warehouse(root)
    wh.write_run("r1", model="scripted-model", image="sandflow:test", dataset="smoke")
    scores, usage = [], []
    with wh.writer() as w:
        for domain in ("math", "chem"):
            for mode in ("sandbox", "llm"):
                for k in range(4):
                    n = 3 if mode == "sandbox" else 1
                    term = "model_error" if (domain, mode, k) == ("chem", "llm", 3) else "submitted"
                    ep, turns = make_episode(
                        "r1", f"{domain}-{k}", mode=mode, domain=domain, turns=n,
                        termination=term, timeout_turn=1 if (domain, mode, k) == ("math", "sandbox", 0) else None,
                    )  # fmt: skip
                    record(w, ep, turns)
                    passed = k < (3 if mode == "sandbox" else 1)
                    scores.append(
                        {"run_id": "r1", "episode_id": ep.episode_id, "verifier": "exact",
                         "score": float(passed), "passed": passed, "reason": "match" if passed else "wrong"}
                    )  # fmt: skip
                    if mode == "sandbox":
                        for t in turns:
                            cap = "computation" if t.turn_index < 2 else "file_management"
                            usage.append(
                                {"run_id": "r1", "episode_id": ep.episode_id, "turn_index": t.turn_index,
                                 "call_index": 0, "capability": cap, "tool": "execute_bash"}
                            )  # fmt: skip
    wh.write_scores(scores)
    wh.write_usage(usage)
    wh.finish_run("r1")
    return wh


def test_ready_made_views_answer_the_common_questions(tmp_path: Path) -> None:
    wh = _populate(tmp_path)
    with wh.query() as q:
        acc = q.rows(
            "SELECT domain, mode, episodes, infra_failures, scored, accuracy FROM accuracy "
            "ORDER BY domain, mode"
        )
        assert acc == [
            ("chem", "llm", 4, 1, 3, pytest.approx(1 / 3, abs=1e-4)),
            ("chem", "sandbox", 4, 0, 4, 0.75),
            ("math", "llm", 4, 0, 4, 0.25),
            ("math", "sandbox", 4, 0, 4, 0.75),
        ]
        tok = q.rows(
            "SELECT turns, prompt_tokens, completion_tokens, tool_calls FROM episode_tokens "
            "WHERE domain = 'math' AND mode = 'sandbox' AND task_id = 'math-1'"
        )
        assert tok == [(3, 100 + 110 + 120, 60, 3)]
        cap = q.rows(
            "SELECT domain, capability, turns_with_capability, turns, rate FROM capability_usage "
            "WHERE mode = 'sandbox' ORDER BY domain, capability"
        )
        assert cap == [
            ("chem", "computation", 8, 12, pytest.approx(0.6667, abs=1e-4)),
            ("chem", "file_management", 4, 12, pytest.approx(0.3333, abs=1e-4)),
            ("math", "computation", 8, 12, pytest.approx(0.6667, abs=1e-4)),
            ("math", "file_management", 4, 12, pytest.approx(0.3333, abs=1e-4)),
        ]
        (slow,) = q.rows("SELECT tool, calls, timeouts, max_s FROM slow_tools")
        assert slow == ("execute_bash", 4 * 3 * 2 + 4 * 2, 1, 30.0)
        assert q.rows("SELECT task_id, command FROM timeouts") == [("math-0", "sleep 999")]
        errs = dict(q.rows("SELECT termination, episodes FROM errors"))
        assert errs == {"submitted": 15, "model_error": 1}
        # a second verifier: accuracy keeps one verdict per episode (the newest)
        wh.write_scores(
            [{"run_id": "r1", "episode_id": e, "verifier": "judge", "score": 1.0}
             for e in wh.done_episode_ids("r1", include_infra=True)]
        )  # fmt: skip
        q.refresh()
        assert q.rows("SELECT sum(episodes), min(accuracy), max(verifiers) FROM accuracy") == [
            (16, 1.0, "judge")
        ]
        assert q.rows(
            "SELECT verifier, sum(scored) FROM accuracy_by_verifier GROUP BY 1 ORDER BY 1"
        ) == [("exact", 15), ("judge", 15)]
        (run,) = q.rows("SELECT model, status, ended_at IS NOT NULL FROM runs")
        assert run == ("scripted-model", "finished", True)


def test_every_view_exists_on_an_empty_warehouse(tmp_path: Path) -> None:
    with Warehouse(tmp_path).query() as q:
        views = q.views()
        assert set(views) == set(VIEW_HELP)
        for name in views:
            assert q.rows(f"SELECT count(*) FROM {name}") == [(0,)]
        assert ("turn_index", "INTEGER") in views["turns"]


def test_missing_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WarehouseNotFound, match=r"does-not-exist does not exist.*--warehouse"):
        Warehouse(tmp_path / "does-not-exist").query()


def test_sql_errors_name_the_problem(tmp_path: Path) -> None:
    with Warehouse(tmp_path).query() as q:
        with pytest.raises(WarehouseQueryError, match=r"(?s)SQL error.*episdes.*views: runs"):
            q.rows("SELECT * FROM episdes")
        with pytest.raises(WarehouseQueryError, match=r"SQL error \(ParserException\)"):
            q.rows("SELEC 1")
        with pytest.raises(WarehouseQueryError, match="empty SQL"):
            q.sql("  ")


def test_bad_files_are_named_and_the_rest_stays_readable(tmp_path: Path) -> None:
    wh = _populate(tmp_path)
    part = tmp_path / "turns" / "run_id=r1"
    good = sorted(part.glob("*.parquet"))
    # 1. truncated copy of a real file (what a crash mid-write without rename leaves)
    data = good[0].read_bytes()
    (part / "truncated.parquet").write_bytes(data[: len(data) // 2])
    # 2. a foreign Parquet file dropped into the table
    pq.write_table(pa.table({"city": ["Paris"], "pop": [2_100_000]}), part / "foreign.parquet")
    # 3. not Parquet at all
    (part / "notes.parquet").write_text("these are my notes, not a Parquet file")
    # 4. a file of another table in the wrong place
    shutil.copy(
        next((tmp_path / "episodes" / "run_id=r1").glob("*.parquet")), part / "misplaced.parquet"
    )
    with wh.query() as q:
        reasons = {b.path.name: b.reason for b in q.snapshot.bad}
        assert set(reasons) == {
            "truncated.parquet",
            "foreign.parquet",
            "notes.parquet",
            "misplaced.parquet",
        }
        assert "magic bytes" in reasons["truncated.parquet"]
        assert (
            "foreign schema" in reasons["foreign.parquet"] and "city" in reasons["foreign.parquet"]
        )
        assert "magic bytes" in reasons["notes.parquet"]
        assert "belongs to table 'episodes'" in reasons["misplaced.parquet"]
        (n,) = q.rows("SELECT count(*) FROM turns")[0]
        assert n == 8 * 3 + 8 * 1
    # quarantine moves them aside, with the reason next to each
    with wh.query(quarantine=True) as q:
        assert len(q.snapshot.quarantined) == 4
    assert sorted(p.name for p in part.glob("*.parquet")) == [p.name for p in good]
    qdir = tmp_path / "_quarantine" / "turns" / "run_id=r1"
    assert "magic bytes" in (qdir / "truncated.parquet.reason.txt").read_text()
    with wh.query() as q:
        assert q.snapshot.bad == []


def test_corrupt_footer_with_valid_magic(tmp_path: Path) -> None:
    wh = _populate(tmp_path)
    part = tmp_path / "episodes" / "run_id=r1"
    victim = sorted(part.glob("*.parquet"))[0]
    data = bytearray(victim.read_bytes())
    data[-40:-8] = b"\xff" * 32  # footer bytes smashed, magic intact
    victim.write_bytes(bytes(data))
    with wh.query() as q:
        assert [b.path for b in q.snapshot.bad] == [victim]
        assert "corrupt Parquet footer" in q.snapshot.bad[0].reason
        assert q.rows("SELECT count(*) FROM episodes") == [(15,)]


def test_old_file_without_a_new_column_still_reads(tmp_path: Path) -> None:
    """Schema evolution: a file written before a column existed reads with NULL there."""
    wh = _populate(tmp_path)
    part = tmp_path / "turns" / "run_id=r1"
    victim = sorted(part.glob("*.parquet"))[0]
    old = pq.read_table(victim)
    old = old.drop_columns(["reasoning_tokens", "completion_logprobs"])  # "version 0" file
    pq.write_table(
        old.replace_schema_metadata(
            {b"sandflow.table": b"turns", b"sandflow.schema_version": b"0"}
        ),
        victim,
    )
    with wh.query() as q:
        assert q.snapshot.bad == []
        (n, nulls) = q.rows(
            "SELECT count(*), count(*) FILTER (WHERE completion_logprobs IS NULL) FROM turns"
        )[0]
        assert n == 32 and nulls == old.num_rows
    # Every file old: the views still have every column (added as typed NULLs).
    for f in part.glob("*.parquet"):
        t = pq.read_table(f)
        t = t.drop_columns([c for c in ("reasoning_tokens",) if c in t.column_names])
        pq.write_table(t.replace_schema_metadata({b"sandflow.table": b"turns"}), f)
    with wh.query() as q:
        assert q.rows("SELECT count(reasoning_tokens), count(*) FROM turns") == [(0, 32)]
        assert q.rows("SELECT sum(turns) FROM episode_tokens") == [(32,)]


def test_run_filter_reads_one_partition(tmp_path: Path) -> None:
    wh = _populate(tmp_path)
    ep, turns = make_episode("r2", "x")
    with wh.writer() as w:
        record(w, ep, turns)
    with wh.query(run_id="r2") as q:
        assert q.rows("SELECT DISTINCT run_id FROM turns") == [("r2",)]
    with wh.query() as q:
        assert q.rows("SELECT run_id, count(*) FROM episodes GROUP BY 1 ORDER BY 1") == [
            ("r1", 16),
            ("r2", 1),
        ]


def test_the_egress_views_cache_hit_agrees_with_the_records(tmp_path: Path) -> None:
    """`cache_hit` in SQL and EgressRecord.cache_hit (the benchmark's and the tests' count)
    are one definition: served without a fetch of its own, including a request collapsed
    onto another sandbox's fetch in flight (TCP_CF_MISS)."""
    from datetime import UTC, datetime

    from sandbox.egress import EgressRecord
    from tasks.records import EgressRequest

    codes = ["TCP_MISS", "TCP_HIT", "TCP_MEM_HIT", "TCP_CF_MISS", "TCP_CF_HIT",
             "TCP_REFRESH_UNMODIFIED", "TCP_REFRESH_MODIFIED", "TCP_TUNNEL", "TCP_DENIED"]  # fmt: skip
    ep, (turn,) = make_episode("r-egress", "t", turns=1)
    requests = [
        EgressRequest(time=datetime.now(UTC), method="GET", host="pypi.test", port=80,
                      url=f"http://pypi.test/{code}", status=200, allowed=True, rule="allow",
                      result=code)  # fmt: skip
        for code in codes
    ]
    with Warehouse(tmp_path).writer(durability="flush") as w:
        record(w, ep, [turn.model_copy(update={"egress": requests})])
    from warehouse.query import WarehouseQuery

    with WarehouseQuery(tmp_path) as q:
        in_sql = dict(q.rows("SELECT result, cache_hit FROM egress"))
    in_python = {
        code: EgressRecord(time=0.0, client="10.0.0.2", method="GET", host="pypi.test", port=80,
                           url="", status=200, bytes_out=0, bytes_in=0, result=code, server="-",
                           allowed=True, rule="allow").cache_hit  # fmt: skip
        for code in codes
    }
    assert in_sql == in_python
    assert [c for c in codes if in_python[c]] == [
        "TCP_HIT", "TCP_MEM_HIT", "TCP_CF_MISS", "TCP_CF_HIT", "TCP_REFRESH_UNMODIFIED"
    ]


def test_a_file_changed_while_read_is_read_again_from_a_fresh_listing(tmp_path: Path) -> None:
    """warehouse.query.reread_changed, the one home of "refresh and retry" (the views'
    build, `sandflow sql`, the viewer): real DuckDB errors, real files."""
    import duckdb

    from warehouse.query import reread_changed
    from warehouse.validate import FilesVanished

    con = duckdb.connect()
    listed = [tmp_path / "a.parquet"]
    pq.write_table(pa.table({"x": [1]}), listed[0])
    listed[0].unlink()  # a compaction merged it away after the snapshot listed it
    renewed: list[Path] = []

    def renew() -> None:  # the next listing names the merged file
        merged = tmp_path / f"merged-{len(renewed)}.parquet"
        pq.write_table(pa.table({"x": [1, 2]}), merged)
        listed[0] = merged
        renewed.append(merged)

    def count() -> int:
        return con.execute(f"SELECT count(*) FROM read_parquet('{listed[0]}')").fetchone()[0]

    never_bad = lambda exc: False  # noqa: E731
    assert reread_changed(count, attempts=3, renew=renew, leave_out=never_bad) == 2
    assert len(renewed) == 1

    # still vanishing on the last attempt: one sentence naming what failed, not a traceback
    gone = tmp_path / "gone.parquet"
    with pytest.raises(WarehouseQueryError, match="reading the warehouse failed: .*gone.parquet"):
        reread_changed(
            lambda: con.execute(f"SELECT * FROM read_parquet('{gone}')").fetchall(),
            attempts=2, renew=lambda: None, leave_out=never_bad,
        )  # fmt: skip

    # the SQL's own error is not a changed file: raised at once, as the caller words it
    calls: list[int] = []
    with pytest.raises(WarehouseQueryError, match="^bad SQL: .*nosuch"):
        reread_changed(
            lambda: calls.append(1) or con.execute("SELECT nosuch FROM range(1)").fetchall(),
            attempts=3, renew=lambda: calls.append(0), leave_out=never_bad,
            other=lambda exc: WarehouseQueryError(f"bad SQL: {exc}"),
        )  # fmt: skip
    assert calls == [1]

    # a file found corrupt is left out (leave_out: True) and the query runs on the renewal
    left_out: list[str] = []
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"x": [7]}), good)
    source = [bad]

    def leave_out(exc: duckdb.Error) -> bool:
        left_out.append(type(exc).__name__)
        source[0] = good
        return True

    read = lambda: con.execute(f"SELECT x FROM read_parquet('{source[0]}')").fetchall()  # noqa: E731
    assert reread_changed(read, attempts=2, renew=lambda: None, leave_out=leave_out) == [(7,)]
    assert len(left_out) == 1

    # files that keep changing (FilesVanished from a build) end in the caller's sentence
    def build() -> None:
        raise FilesVanished("turns: t1.parquet")

    with pytest.raises(WarehouseQueryError, match="kept changing"):
        reread_changed(
            build, attempts=3, renew=lambda: None, leave_out=never_bad,
            gave_up="files kept changing while the views were built",
        )  # fmt: skip
