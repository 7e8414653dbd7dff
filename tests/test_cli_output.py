"""Issue #22.13: output that is not a terminal never cuts or wraps a path, id or number.

rich lays out to 80 columns (or $COLUMNS) when stdout is not a terminal, so `warehouse
check` printed a bad file's path in two pieces and a test failed on a machine whose
temporary paths were longer. Every command prints through sandflow/console.py, which
never wraps off a terminal. Here each command runs as a real child process with stdout
and stderr pipes, COLUMNS=40 and a temporary directory whose path is ~290 characters,
and every path, id and number it prints must arrive whole on one line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warehouse.factory import make_episode, record
from tests.warehouse.test_read_cache import _corrupt_data_pages

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def long_tmp(tmp_path: Path) -> Path:
    d = tmp_path / ("long-" + "x" * 120) / ("deeper-" + "y" * 120)
    d.mkdir(parents=True)
    return d


def _sandflow(long_tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "40", "TMPDIR": str(long_tmp)}
    env.pop("FORCE_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "sandflow.cli", *args],
        cwd=REPO,
        capture_output=True,  # pipes: not a terminal
        text=True,
        timeout=300,
        env=env,
    )


def _on_one_line(text: str, *wanted: str) -> None:
    lines = text.splitlines()
    for w in wanted:
        assert any(w in ln for ln in lines), f"{w!r} is not whole on any line of:\n{text}"


def test_paths_ids_and_numbers_arrive_whole_in_a_pipe(long_tmp: Path) -> None:
    from warehouse import Warehouse

    root = long_tmp / "wh"
    long_task = "task-" + "z" * 150
    with Warehouse(root).writer(durability="flush") as w:
        for tid in (long_task, "t1"):
            ep, ts = make_episode("r1", tid, turns=2)
            record(w, ep, ts)
    victim = sorted((root / "turns" / "run_id=r1").glob("*.parquet"))[0]
    _corrupt_data_pages(victim)

    # warehouse check: the bad file's path (stderr) whole
    r = _sandflow(long_tmp, "warehouse", "check", "-w", str(root))
    assert r.returncode == 1, r.stdout + r.stderr
    _on_one_line(r.stderr, f"{victim}: corrupt data pages")

    # sql in table format (a table, not csv): ids, a long number and a path whole
    r = _sandflow(
        long_tmp, "sql",
        "SELECT task_id, episode_id, 123456789012345678 AS big, "
        f"'{root}' AS root FROM episodes ORDER BY task_id",
        "-w", str(root),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (eid,) = [e.episode_id for e in [make_episode("r1", long_task)[0]]]
    _on_one_line(r.stdout, long_task, eid, "123456789012345678", str(root))
    _on_one_line(r.stderr, str(victim))  # the bad file named on the way (a known one now)

    # compaction names the bad file it left out
    r = _sandflow(long_tmp, "warehouse", "compact", "r1", "-w", str(root))
    assert r.returncode == 0, r.stderr
    _on_one_line(r.stderr, str(victim))

    # tasks prepare: the table and the path it wrote
    out = long_tmp / "set.jsonl"
    r = _sandflow(long_tmp, "tasks", "prepare", "smoke", "--size", "3", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    _on_one_line(r.stdout, f"wrote {out}")
    assert re.search(r"content hash [0-9a-f]{64}\)", r.stdout), r.stdout  # whole, not 12

    # an error message naming a path
    missing = long_tmp / "no-such-warehouse"
    r = _sandflow(long_tmp, "sql", "SELECT 1", "-w", str(missing))
    assert r.returncode == 1
    _on_one_line(r.stderr, f"warehouse root {missing} does not exist")

    # an error typer itself prints (a bad flag value), not in a panel wrapped at 40
    gone = long_tmp / "no-such-input-dir"
    r = _sandflow(long_tmp, "run", "--input-dir", str(gone), "--query", "hi")
    assert r.returncode == 2
    _on_one_line(r.stderr, f"'{gone}' does not exist")
