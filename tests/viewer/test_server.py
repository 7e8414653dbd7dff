"""The viewer without a browser: read-only SQL, escaping and headers, secrets, folding,
filters from URLs, the snapshot following the warehouse, and the CLI's errors."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from sandflow.viewer import data, present
from sandflow.viewer.readonly import check_read_only
from tests.viewer.conftest import FAKE_KEY, HOSTILE, LATE_SECRET, RUN_A, ViewerServer, start_viewer
from warehouse.query import WarehouseQueryError


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT 1) TO '/tmp/x.csv'",
        "EXPLAIN ANALYZE COPY (SELECT 1) TO '/tmp/x.csv'",
        "ATTACH '/tmp/x.db'",
        "DROP VIEW turns",
        "CREATE VIEW episodes AS SELECT 1",
        "INSERT INTO t VALUES (1)",
        "SET enable_external_access = true",
        "PRAGMA version",
        "INSTALL httpfs",
        "SELECT 1; COPY (SELECT 1) TO '/tmp/x.csv'",
        "",
    ],
)
def test_only_one_select_passes(sql: str) -> None:
    with pytest.raises(WarehouseQueryError):
        check_read_only(sql)


@pytest.mark.parametrize(
    "sql", ["SELECT 1", "FROM turns", "WITH a AS (SELECT 1) SELECT * FROM a", "EXPLAIN SELECT 1;"]
)
def test_queries_pass(sql: str) -> None:
    assert check_read_only(sql)


def test_pages_escape_and_send_security_headers(viewer: ViewerServer) -> None:
    r = httpx.get(viewer.url + f"/runs/{RUN_A}?task=hostile")
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "<script>window" not in r.text and "&lt;script&gt;window" in r.text
    # a request naming another host (DNS rebinding) is refused
    assert httpx.get(viewer.url + "/", headers={"Host": "evil.example"}).status_code == 400


def test_secrets_are_masked(viewer: ViewerServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDFLOW_API_KEY", LATE_SECRET)
    r = httpx.get(
        viewer.url + "/sql",
        params={"q": "SELECT assistant_content, 'x' AS api_key FROM turns WHERE assistant_content LIKE '%plan%'"},
    )
    assert r.status_code == 200 and "Here is my plan" in r.text
    assert FAKE_KEY not in r.text and LATE_SECRET not in r.text


def test_bad_ids_and_missing_things_say_so(viewer: ViewerServer) -> None:
    for path, says in [
        ("/runs/no-such-run", "has no records"),
        ("/runs/bad%20id", "invalid run_id"),
        (f"/runs/{RUN_A}/episodes/not.an.id", "invalid episode_id"),
        (f"/runs/{RUN_A}/episodes/abc", "is not in run"),
        ("/compare?a=x", "Two episodes needed"),
    ]:
        r = httpx.get(viewer.url + path)
        assert r.status_code in (400, 404), path
        assert says in r.text, (path, r.text[-500:])


def test_filters_from_urls_are_bounded() -> None:
    f = data.EpisodeFilter.from_query(
        {"sort": "task_id; DROP VIEW turns", "score": "nope", "usage": "x'--", "min_score": "abc", "desc": "1"}
    )
    assert f.sort == "task" and f.score is None and f.usage is None and f.min_score is None and f.desc
    conds, params = data.EpisodeFilter(domain="a' OR 1=1 --", task="%").where()
    assert params == ["a' OR 1=1 --", "%"] and all("'" not in c.replace("'none'", "") for c in conds)


def test_fold_and_arguments() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    f = present.fold(text)
    assert f.head.count("\n") == present.FOLD_LINES and f.folded and f.head + f.rest == text
    assert f.rest_lines == 100 - present.FOLD_LINES and f.lines == 100
    assert not present.fold("short\n").folded
    big = present.fold("x" * (present.MAX_FIELD_CHARS + 10))
    assert big.cut == 10 and len(big.head + big.rest) == present.MAX_FIELD_CHARS
    ok, head, args = present.parse_arguments("str_replace_editor", '{"command": "view", "path": "/a", "view_range": [1, 2]}')
    assert ok and head == "view /a" and [a.name for a in args] == ["view_range"]
    ok, head, args = present.parse_arguments("execute_bash", '{"command": "ls')
    assert not ok and head is None and args[0].value == '{"command": "ls'
    assert HOSTILE  # (the hostile fixtures are exercised in the browser tests)


def test_snapshot_follows_the_warehouse(tmp_path: Path) -> None:
    """A new episode appears without a restart; the viewer writes nothing."""
    from tests.warehouse.factory import make_episode, record
    from warehouse import Warehouse

    root = tmp_path / "wh"
    wh = Warehouse(root)
    w = wh.writer(durability="flush")
    ep, turns = make_episode("pytest-view-follow", "t1")
    record(w, ep, turns)
    srv = start_viewer(root, refresh_s=0.1)
    try:
        before = {p for p in root.rglob("*") if p.is_file()}
        assert httpx.get(srv.url + "/runs/pytest-view-follow").text.count("data-episode=") == 1
        ep2, turns2 = make_episode("pytest-view-follow", "t2")
        record(w, ep2, turns2)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if httpx.get(srv.url + "/runs/pytest-view-follow").text.count("data-episode=") == 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the new episode never showed up")
        after = {p for p in root.rglob("*") if p.is_file()}
        new = {p for p in after - before if ep2.episode_id not in p.name}
        assert {p.name for p in new} <= {".readers.lock"}, new
    finally:
        w.close()
        srv.stop()


def test_cli_errors_and_help(tmp_path: Path) -> None:
    from sandflow.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["view", "--warehouse", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "does not exist" in res.output
    res = runner.invoke(app, ["view", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--sql-timeout" in res.output and "side by side" in res.output


def test_a_corrupt_turns_file_is_named_not_a_server_error(tmp_path: Path) -> None:
    """A file whose data pages do not decode (a torn copy, a bad disk) is found when a
    page reads it, left out like `sandflow sql` leaves it out, and named: on its
    episode's page in place of the turns, and in every page's banner. The other
    episodes still read, and the SQL box counts without it. The file's path is named
    whole however long it is (a cluster's TMPDIR, a deep clone): a cut path names nothing."""
    from tests.warehouse.factory import make_episode, record
    from warehouse import Warehouse

    root = tmp_path / ("a-long-folder-" * 12) / "wh"
    run = "pytest-view-corrupt"
    with Warehouse(root).writer(durability="flush") as w:
        eps = [make_episode(run, f"t{k}", turns=3) for k in range(3)]
        for ep, turns in eps:
            record(w, ep, turns)
    victim = eps[1][0].episode_id
    (bad,) = (root / "turns" / f"run_id={run}").glob(f"{victim}.*.parquet")
    data_ = bytearray(bad.read_bytes())
    for i in range(200, min(len(data_) // 2, 1200)):  # the pages, not the header or footer
        data_[i] ^= 0x5A
    bad.write_bytes(bytes(data_))
    srv = start_viewer(root)
    try:
        r = httpx.get(f"{srv.url}/runs/{run}/episodes/{victim}")
        assert r.status_code == 200, r.text[-800:]
        assert "turns are in a file left out as bad" in r.text and str(bad) in r.text
        ok = httpx.get(f"{srv.url}/runs/{run}/episodes/{eps[0][0].episode_id}")
        assert ok.status_code == 200 and ok.text.count('class="turn') >= 3
        assert "1 bad file(s) left out" in ok.text and str(bad) in ok.text
        r = httpx.get(srv.url + "/sql", params={"q": "SELECT count(*) AS n FROM turns"})
        assert r.status_code == 200 and ">6<" in r.text.replace(" ", ""), r.text[-1500:]
    finally:
        srv.stop()
