"""`sandflow sql` and `sandflow warehouse ...` through typer's CliRunner."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from sandflow.cli import app
from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse

runner = CliRunner()


def _wh(root: Path) -> Warehouse:
    wh = Warehouse(root)
    with wh.writer() as w:
        for k in range(3):
            ep, turns = make_episode("r1", f"t{k}", turns=2, domain="math" if k else "chem")
            record(w, ep, turns)
    return wh


def _run(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(app, list(args), env={"COLUMNS": "200", **(env or {})})


def test_sql_prints_a_table(tmp_path: Path) -> None:
    _wh(tmp_path)
    r = _run(
        "sql",
        "SELECT domain, count(*) AS n FROM episodes GROUP BY 1 ORDER BY 1",
        "-w",
        str(tmp_path),
    )
    assert r.exit_code == 0, r.output
    assert "domain" in r.stdout and "chem" in r.stdout and "math" in r.stdout
    assert "2 rows" in r.stdout
    r = _run("sql", "SELECT * FROM turns", "-w", str(tmp_path), "--limit", "2")
    assert r.exit_code == 0 and "first 2 rows shown" in r.stdout


def test_sql_warehouse_from_env(tmp_path: Path) -> None:
    _wh(tmp_path)
    r = _run("sql", "SELECT count(*) AS n FROM episodes", env={"SANDFLOW_WAREHOUSE": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert " 3 " in r.stdout


def test_sql_exports_csv_json_parquet(tmp_path: Path) -> None:
    _wh(tmp_path / "wh")
    q = "SELECT episode_id, turn_index, tool_calls FROM turns ORDER BY 1, 2"
    out = tmp_path / "t.csv"
    r = _run("sql", q, "-w", str(tmp_path / "wh"), "--format", "csv", "--output", str(out))
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == 6 and json.loads(rows[0]["tool_calls"])[0]["name"] == "execute_bash"
    r = _run("sql", q, "-w", str(tmp_path / "wh"), "--format", "json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert len(data) == 6 and data[1]["turn_index"] == 1
    out = tmp_path / "t.parquet"
    r = _run("sql", q, "-w", str(tmp_path / "wh"), "-f", "parquet", "-o", str(out))
    assert r.exit_code == 0 and pq.read_table(out).num_rows == 6


def test_sql_without_query_lists_views(tmp_path: Path) -> None:
    _wh(tmp_path)
    r = _run("sql", "-w", str(tmp_path))
    assert r.exit_code == 0, r.output
    for view in (
        "episodes",
        "turns",
        "accuracy",
        "capability_usage",
        "slow_tools",
        "partial_turns",
    ):
        assert view in r.stdout
    assert "turn_index" in r.stdout


def test_sql_errors_are_clear(tmp_path: Path) -> None:
    _wh(tmp_path)
    r = _run("sql", "SELECT nope FROM episodes", "-w", str(tmp_path))
    assert r.exit_code == 1
    assert "SQL error" in r.output and "nope" in r.output and "Traceback" not in r.output
    r = _run("sql", "SELECT 1", "-w", str(tmp_path / "missing"))
    assert r.exit_code == 1 and "does not exist" in r.output
    r = _run("sql", "SELECT 1", "-w", str(tmp_path), "--format", "xml")
    assert r.exit_code == 2 and "--format must be one of" in r.output
    r = _run("sql", "SELECT 1", "-w", str(tmp_path), "--format", "parquet")
    assert r.exit_code == 2 and "needs --output" in r.output


def test_sql_warns_about_bad_files(tmp_path: Path) -> None:
    _wh(tmp_path)
    bad = tmp_path / "episodes" / "run_id=r1" / "broken.parquet"
    bad.write_bytes(b"PAR1 not really")
    r = _run("sql", "SELECT count(*) AS n FROM episodes", "-w", str(tmp_path))
    assert r.exit_code == 0
    assert "broken.parquet" in r.output and "1 bad file" in r.output and " 3 " in r.stdout
    r = _run("warehouse", "check", "-w", str(tmp_path))
    assert r.exit_code == 1 and "1 bad" in r.output


def test_warehouse_compact_and_orphans_commands(tmp_path: Path) -> None:
    wh = _wh(tmp_path)
    ep, turns = make_episode("r1", "dangling", turns=2)
    w = wh.writer()
    w.start_episode(ep)
    w.record_turn(turns[0])
    w.close()
    r = _run("warehouse", "orphans", "r1", "-w", str(tmp_path))
    assert r.exit_code == 0 and "1 orphaned" in r.stdout and "dangling" in r.stdout
    r = _run("warehouse", "orphans", "r1", "-w", str(tmp_path), "--recover")
    assert r.exit_code == 0 and "recovered 1" in r.stdout
    r = _run("warehouse", "compact", "r1", "-w", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "episodes: 4 file(s) -> 1" in r.stdout
    r = _run(
        "sql",
        "SELECT termination, count(*) AS n FROM episodes GROUP BY 1 ORDER BY 1",
        "-w",
        str(tmp_path),
    )
    assert "interrupted" in r.stdout and "submitted" in r.stdout


def test_help_teaches(tmp_path: Path) -> None:
    r = _run("sql", "--help")
    assert r.exit_code == 0 and "accuracy" in r.stdout and "--format" in r.stdout


def test_interactive_prompt(tmp_path: Path, monkeypatch) -> None:
    """The prompt `sandflow sql` opens on a terminal: multi-line SQL, errors, .views, .quit."""
    from rich.console import Console

    from sandflow.commands.sql import _interactive

    wh = _wh(tmp_path)
    lines = iter(["SELECT count(*) AS n", "FROM episodes;", "SELECT nope;", ".views", ".quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    console = Console(record=True, width=200)
    with wh.query() as q:
        _interactive(q, console, limit=10, width=40)
    out = console.export_text()
    assert "1 row" in out and " 3 " in out
    assert "SQL error" in out and "nope" in out
    assert "capability_usage" in out  # .views listed them
