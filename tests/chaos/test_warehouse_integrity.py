"""The warehouse under damage and abuse: corrupt pages, dead temp files, hostile SQL.

- A Parquet file whose header and footer are intact but whose data pages are corrupt (a
  bad disk block) passes a footer check. `sandflow warehouse check` reads every page and
  names it; a query that trips over it names it too and leaves it out (never an anonymous
  DuckDB error); compaction leaves it out and never deletes it.
- A writer killed with SIGKILL in the middle of writing a Parquet file leaves a hidden
  temporary file. No view reads it, and compaction and the next run of that run id delete
  it, while a temporary file whose writer is alive is left alone.
- `sandflow sql` reads the warehouse and nothing else: COPY ... TO, EXPORT, ATTACH,
  INSTALL/LOAD, SET and reading host files are refused, also in disguise (EXPLAIN ANALYZE,
  query(), PRAGMA import, `..` paths); `--allow-host-files` gives the user DuckDB's full
  access for their own exports.

Real parts only: the warehouse writer, pyarrow, DuckDB, a real child process and SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.warehouse.factory import make_episode, record

pytestmark = pytest.mark.chaos

REPO = Path(__file__).resolve().parents[2]


def _warehouse(root: Path, n: int = 3, turns: int = 30) -> None:
    from warehouse import Warehouse

    with Warehouse(root).writer(durability="flush") as w:
        for k in range(n):
            ep, ts = make_episode("r1", f"t{k}", turns=turns)
            record(w, ep, ts)


def _corrupt_data_pages(path: Path) -> None:
    """Flip bytes between the header magic and the footer: both stay intact."""
    data = bytearray(path.read_bytes())
    footer = pq.read_metadata(path).serialized_size
    end = len(data) - footer - 8
    for i in range(8, end, 29):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    assert data[:4] == b"PAR1" and data[-4:] == b"PAR1"
    pq.read_metadata(path)  # the footer still parses


def _cli(*args: str):
    from sandflow.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


# ---------------------------------------------------------------------- corrupt data pages
def test_corrupt_data_pages_fail_check_and_are_named_by_queries(tmp_path: Path) -> None:
    from warehouse import Warehouse

    root = tmp_path / "wh"
    _warehouse(root)
    victim = sorted((root / "turns" / "run_id=r1").glob("*.parquet"))[1]
    _corrupt_data_pages(victim)

    # a query that reads the pages (first: nothing cached yet) names the file, leaves it
    # out, and answers from the rest
    r = _cli(
        "sql", "SELECT count(*) AS n, count(DISTINCT episode_id) AS e FROM turns", "-w", str(root)
    )
    assert r.exit_code == 0, r.output
    assert victim.name in r.output and "bad file" in r.output, r.output
    assert " 60 " in r.stdout and " 2 " in r.stdout, r.stdout  # the two good episodes' turns

    # check: reads every page and names the file; exit 1
    r = _cli("warehouse", "check", "-w", str(root))
    assert r.exit_code == 1, r.output
    assert victim.name in r.output and "corrupt data pages" in r.output, r.output

    # the Python API: no anonymous DuckDB error either; the file is listed as bad
    wh = Warehouse(root)
    with wh.query() as q:
        rows = q.rows("SELECT episode_id, turn_index, assistant_content FROM turns")
        assert len(rows) == 60
        assert [b.path for b in q.snapshot.bad] == [victim]
        assert "corrupt data pages" in q.snapshot.bad[0].reason


def test_corrupt_episode_file_is_named_while_the_views_are_built(tmp_path: Path) -> None:
    """Episode rows are read when a session opens (pinned): the failure is there, not in a query."""
    root = tmp_path / "wh"
    _warehouse(root)
    victim = sorted((root / "episodes" / "run_id=r1").glob("*.parquet"))[0]
    _corrupt_data_pages(victim)
    # in a fresh process: nothing cached from an earlier check
    code = textwrap.dedent(
        f"""
        from warehouse import Warehouse
        with Warehouse({str(root)!r}).query() as q:
            print("episodes", q.rows("SELECT count(*) FROM episodes")[0][0])
            print("bad", [str(b) for b in q.snapshot.bad])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "episodes 2" in out.stdout, out.stdout + out.stderr
    assert victim.name in out.stdout and "corrupt data pages" in out.stdout


def test_compaction_leaves_a_corrupt_file_out_and_keeps_it(tmp_path: Path) -> None:
    from warehouse import Warehouse

    root = tmp_path / "wh"
    _warehouse(root)
    victim = sorted((root / "turns" / "run_id=r1").glob("*.parquet"))[2]
    _corrupt_data_pages(victim)
    res = Warehouse(root).compact("r1")
    assert [b.path for b in res.skipped_bad] == [victim]
    assert res.rows_after["turns"] == 60
    assert victim.exists(), "compaction deleted the only copy of a corrupt file"
    r = _cli("warehouse", "check", "-w", str(root))
    assert r.exit_code == 1 and victim.name in r.output


def test_check_passes_a_sound_warehouse_and_quick_reads_footers_only(tmp_path: Path) -> None:
    root = tmp_path / "wh"
    _warehouse(root)
    r = _cli("warehouse", "check", "-w", str(root))
    assert r.exit_code == 0 and "0 bad (every page read)" in r.output, r.output
    victim = sorted((root / "turns" / "run_id=r1").glob("*.parquet"))[0]
    _corrupt_data_pages(victim)
    r = _cli("warehouse", "check", "-w", str(root), "--quick")
    assert "headers and footers" in r.output


# ---------------------------------------------------------------------- dead temp files
_SLOW_WRITER = """
import sys
import numpy as np
import pyarrow as pa
from pathlib import Path
from warehouse.layout import write_parquet_atomic
dest = Path(sys.argv[1])
table = pa.table({"x": pa.array(np.random.default_rng(0).integers(0, 2**62, 40_000_000))})
print("writing", flush=True)
for _ in range(100):
    write_parquet_atomic(table, dest)
"""


def _kill_mid_write(dest: Path) -> Path:
    """Start a real writer, SIGKILL it while its temp file is being written; return the temp."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(dest)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            temps = [p for p in dest.parent.glob(".*.tmp") if p.stat().st_size > 0]
            if temps:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the writer never started its temp file")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = list(dest.parent.glob(".*.tmp"))
    assert len(left) == 1, left
    return left[0]


def test_temp_file_of_a_killed_writer_is_never_read_and_compaction_removes_it(
    tmp_path: Path,
) -> None:
    from warehouse import Warehouse
    from warehouse.layout import Layout

    root = tmp_path / "wh"
    _warehouse(root, n=2, turns=3)
    part = Layout(root).part_dir("turns", "r1")
    dead = _kill_mid_write(part / "zz-big.parquet")

    # invisible to every listing and view (it is half a Parquet file)
    assert dead not in Layout(root).partition_files("turns", "r1")
    r = _cli("sql", "SELECT count(*) AS n FROM _raw_turns", "-w", str(root))
    assert r.exit_code == 0 and " 6 " in r.stdout and "bad" not in r.output, r.output

    # a live writer's temp file beside it must survive the same compaction
    from warehouse.tempfiles import locked_temp

    held = threading.Event()
    release = threading.Event()
    live: list[Path] = []

    def live_writer() -> None:
        with locked_temp(part / "live.parquet") as (tmp, fh):
            fh.write(b"PAR1 half written")
            fh.flush()
            live.append(tmp)
            held.set()
            release.wait(60)
            os.replace(tmp, tmp_path / "finished.bin")  # the writer finishes its work

    t = threading.Thread(target=live_writer)
    t.start()
    try:
        assert held.wait(10)
        res = Warehouse(root).compact("r1")
        assert dead in res.removed_temps
        assert not dead.exists(), "compaction left the dead writer's temp file"
        assert live[0].exists(), "compaction deleted a temp file its writer is still writing"
    finally:
        release.set()
        t.join()
    assert (tmp_path / "finished.bin").read_bytes() == b"PAR1 half written"


def test_resume_removes_the_dead_temp_files_of_its_run(
    tmp_path: Path, prefect_harness: None
) -> None:
    """The run flow, holding the run's lock, clears what a killed writer left (compaction off)."""
    from flows.run import run_flow
    from tests.flows.conftest import new_run_id, run_kwargs, solver, tiny_tasks, write_tasks
    from tests.scripted_model import ScriptedModel
    from warehouse.layout import Layout

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(2))
    wh = tmp_path / "wh"
    rid = new_run_id("tmpclean")
    part = Layout(wh).part_dir("turns", rid)
    part.mkdir(parents=True)
    dead = _kill_mid_write(part / "killed.parquet")
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        out = run_flow(**run_kwargs(ts, model, wh, mode="llm", run_id=rid, compact=False))
    assert out["succeeded"] == 2
    assert not dead.exists(), "resume left the dead writer's temp file"
    assert not list(wh.rglob("*.tmp")), list(wh.rglob("*.tmp"))


# ---------------------------------------------------------------------- read-only SQL
HOSTILE = {
    "copy-out": "COPY (SELECT * FROM episodes) TO '{out}/stolen.csv'",
    "copy-into-warehouse": "COPY (SELECT 1 AS x) TO '{root}/episodes/run_id=r1/forged.parquet'",
    "explain-analyze-copy": "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{root}/forged.csv'",
    "explain-option-analyze-copy": "EXPLAIN (ANALYZE) COPY (SELECT 1 AS x) TO '{root}/forged2.csv'",
    "export": "EXPORT DATABASE '{root}/exported'",
    "attach": "ATTACH '{root}/x.duckdb' AS x",
    "read-csv-passwd": "SELECT * FROM read_csv('/etc/passwd')",
    "read-text-passwd": "SELECT content FROM read_text('/etc/passwd')",
    "read-text-dotdot": "SELECT content FROM read_text('{root}/../../../../etc/passwd')",
    "read-text-environ": "SELECT content FROM read_text('/proc/self/environ')",
    "read-blob-secret": "SELECT content FROM read_blob('{out}/secret.txt')",
    "glob-host": "SELECT * FROM glob('/etc/*')",
    "sibling-prefix": "SELECT * FROM read_csv('{root}-sibling/secret.csv')",
    "install": "INSTALL httpfs",
    "load": "LOAD httpfs",
    "set-access": "SET enable_external_access = true",
    "reset-lock": "RESET lock_configuration",
    "pragma-import": "IMPORT DATABASE '{out}'",
    "query-fn-copy": "SELECT * FROM query('COPY (SELECT 1) TO ''{out}/q.csv''')",
    "two-statements": "SELECT 1; COPY (SELECT 1) TO '{out}/second.csv'",
    "copy-of-a-pivot": "COPY (PIVOT (SELECT 1 AS a) ON a) TO '{out}/pivot.csv'",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_sql_is_read_only_over_the_warehouse(name: str, tmp_path: Path) -> None:
    root = tmp_path / "wh"
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text("TOP-SECRET-42")
    (out / "schema.sql").write_text(f"COPY (SELECT 1) TO '{out}/imported.csv';\n")
    (out / "load.sql").write_text("")
    sib = Path(f"{root}-sibling")
    sib.mkdir()
    (sib / "secret.csv").write_text("a\nTOP-SECRET-42\n")
    _warehouse(root, n=1, turns=2)
    assert _cli("sql", "SELECT 1", "-w", str(root)).exit_code == 0  # creates .readers.lock
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    sql = HOSTILE[name].format(root=root, out=out)
    r = _cli("sql", sql, "-w", str(root))
    assert r.exit_code == 1, f"{name}: ran ({r.exit_code}):\n{r.output}"
    assert "root:" not in r.output and "TOP-SECRET" not in r.output, r.output
    assert "Traceback" not in r.output
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert after == before, f"{name}: files changed: {set(after) ^ set(before)}"


def test_read_only_sql_still_answers_questions(tmp_path: Path) -> None:
    root = tmp_path / "wh"
    _warehouse(root, n=2, turns=2)
    for sql in (
        "SELECT count(*) AS n FROM episodes",
        "EXPLAIN SELECT * FROM turns",
        "EXPLAIN ANALYZE SELECT count(*) FROM turns",
        "DESCRIBE episodes",
        "SUMMARIZE SELECT turn_index FROM turns",
        "PIVOT (SELECT domain, mode FROM episodes) ON mode IN ('sandbox', 'llm') USING count(*)",
        "CREATE TEMP TABLE mine AS SELECT * FROM episodes",
        f"SELECT count(*) FROM read_parquet('{root}/episodes/*/*.parquet')",
    ):
        r = _cli("sql", sql, "-w", str(root))
        assert r.exit_code == 0, f"{sql}:\n{r.output}"
    # a PIVOT without its values runs as several statements, which could hide a COPY
    r = _cli("sql", "PIVOT (SELECT domain, mode FROM episodes) ON mode", "-w", str(root))
    assert r.exit_code == 1 and "IN list" in r.output, r.output
    # exports go through --output, which sandflow writes itself
    dest = tmp_path / "e.csv"
    r = _cli(
        "sql", "SELECT episode_id FROM episodes", "-w", str(root), "-f", "csv", "-o", str(dest)
    )
    assert r.exit_code == 0 and len(dest.read_text().splitlines()) == 3


def test_allow_host_files_is_the_users_explicit_choice(tmp_path: Path) -> None:
    from warehouse.query import ReadOnlyError, WarehouseQueryError, connect

    root = tmp_path / "wh"
    _warehouse(root, n=1, turns=2)
    labels = tmp_path / "labels.csv"
    labels.write_text("task_id,label\nt0,easy\n")
    out = tmp_path / "mine.csv"
    r = _cli(
        "sql", f"COPY (SELECT e.task_id, l.label FROM episodes e JOIN read_csv('{labels}') l "
        f"USING (task_id)) TO '{out}'", "-w", str(root), "--allow-host-files",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert out.read_text().splitlines() == ["task_id,label", "t0,easy"]
    # the Python API: read-only by default as well, host_files=True opens it up
    with connect(root) as q:
        with pytest.raises(ReadOnlyError, match="--allow-host-files"):
            q.rows(f"COPY (SELECT 1) TO '{tmp_path}/api.csv'")
        with pytest.raises(WarehouseQueryError, match="disabled by configuration"):
            q.rows(f"SELECT * FROM read_csv('{labels}')")
    with connect(root, host_files=True) as q:
        assert q.rows(f"SELECT label FROM read_csv('{labels}')") == [("easy",)]
    r = _cli("sql", "--help")
    assert "--allow-host-files" in r.output and "read-only" in r.output.lower()


@pytest.mark.parametrize(
    "sql",
    [
        "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{target}'",
        "EXPLAIN (ANALYZE) COPY (SELECT 1 AS x) TO '{target}'",
        "EXPLAIN ANALYZE DROP VIEW turns",
    ],
)
def test_viewer_sql_box_cannot_explain_analyze_a_write(tmp_path: Path, sql: str) -> None:
    """The viewer's SQL box (web-facing): EXPLAIN ANALYZE runs what it explains."""
    from sandflow.viewer.store import LiveWarehouse
    from warehouse.query import WarehouseQueryError

    root = tmp_path / "wh"
    _warehouse(root, n=1, turns=2)
    target = root / "turns" / "run_id=r1" / "forged.parquet"
    live = LiveWarehouse(root)
    live.open()
    try:
        with pytest.raises(WarehouseQueryError, match="read-only"):
            live.user_sql(sql.format(target=target), limit=10)
        assert live.user_sql("EXPLAIN ANALYZE SELECT count(*) FROM turns", limit=10).rows
        assert live.user_sql("SELECT count(*) AS n FROM turns", limit=10).rows == [{"n": 2}]
    finally:
        live.close()
    assert not target.exists(), "a file was planted in the warehouse through the viewer"
