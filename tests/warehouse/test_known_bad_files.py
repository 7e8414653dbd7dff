"""Issue #22.4: once a file is known bad, every query over the warehouse agrees.

A file whose data pages are corrupt behind an intact footer shows only when a query
decodes those pages. Before: after one query found it, counts over the same warehouse
changed with the columns a query read and with the process (50 turns, then 0, then 50
again in the next process). Now the file is remembered in the warehouse
(warehouse/badfiles.py): left out of every view, digests included, and named by every
session and by the CLI, until it is repaired (rewritten) or quarantined.

Real parts only: the warehouse writer, compaction, pyarrow, DuckDB, the CLI in a fresh
process (nothing cached in memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse

REPO = Path(__file__).resolve().parents[2]


def _record(root: Path, n: int, turns: int) -> None:
    with Warehouse(root).writer(durability="flush") as w:
        for k in range(n):
            ep, ts = make_episode("r1", f"t{k}", turns=turns)
            record(w, ep, ts)


def _corrupt_column(path: Path, column: str, *, keep_identity: bool = False) -> None:
    """Flip bytes inside one column chunk's data pages only; header and footer stay intact.
    keep_identity: write in place and restore the mtime (a disk block that rots: same
    size, inode and mtime, the file's identity unchanged)."""
    st = path.stat()
    rg = pq.read_metadata(path).row_group(0)
    (chunk,) = [
        rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema == column
    ]
    start, size = chunk.data_page_offset, chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    for i in range(start + 20, start + size - 2, 7):
        data[i] ^= 0x5A
    with open(path, "r+b") as fh:  # in place: the inode stays
        fh.write(bytes(data))
    if keep_identity:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _fresh_counts(root: Path) -> tuple[list[int], list[str]]:
    """Counts over different columns, and the bad files named, in a new process."""
    code = (
        "import sys\n"
        "from warehouse import Warehouse\n"
        f"with Warehouse({str(root)!r}).query() as q:\n"
        "    n = [q.rows(s)[0][0] for s in (\n"
        "        'SELECT count(*) FROM turns',\n"
        "        'SELECT count(turn_index) FROM turns',\n"
        "        'SELECT count(*) FROM turns WHERE assistant_content IS NOT NULL',\n"
        "        'SELECT coalesce(sum(turns), 0) FROM episode_tokens')]\n"
        "    print(n)\n"
        "    print([str(b.path) for b in q.snapshot.bad])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    counts, bad = out.stdout.strip().splitlines()[-2:]
    return eval(counts), eval(bad)  # noqa: S307 - our own printed lists


def _sql_cli(root: Path, query: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandflow.cli", "sql", query, "-w", str(root), "--format", "csv"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "40"},
    )


def test_once_a_query_found_a_corrupt_file_every_count_agrees_and_names_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "wh"
    _record(root, 5, turns=10)
    Warehouse(root).compact("r1")
    (victim,) = (root / "turns" / "run_id=r1").glob("compacted-*.parquet")
    backup = victim.read_bytes()
    _corrupt_column(victim, "assistant_content")

    # Not known yet: a count that decodes no assistant_content page cannot see it.
    counts, bad = _fresh_counts(root)
    assert counts[:2] == [50, 50] and bad == []

    # A query that reads the column finds it, names it and leaves it out ...
    with Warehouse(root).query() as q:
        assert q.rows("SELECT sum(length(assistant_content)) FROM turns") == [(None,)]
        assert [b.path for b in q.snapshot.bad] == [victim]
        # ... and from then on every count in this session agrees
        assert q.rows("SELECT count(*) FROM turns") == [(0,)]
        assert q.rows("SELECT count(turn_index) FROM turns") == [(0,)]

    # so does every later session, in any process, over any columns, and each names it
    counts, bad = _fresh_counts(root)
    assert counts == [0, 0, 0, 0] and bad == [str(victim)]
    r = _sql_cli(root, "SELECT count(*) AS n FROM turns")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ['"n"', "0"], r.stdout
    named = [ln for ln in r.stderr.splitlines() if ln.strip().startswith(f"{victim}: ")]
    assert named, r.stderr  # whole, on one line, whatever the width (COLUMNS=40)
    assert "corrupt data pages" in r.stderr

    # the episodes stay readable (their file is sound)
    with Warehouse(root).query() as q:
        assert q.rows("SELECT count(*) FROM episodes") == [(5,)]

    # repaired (restored from a copy: a new identity): counted again, named no more
    tmp = victim.with_name(".restore.tmp")
    tmp.write_bytes(backup)
    os.replace(tmp, victim)
    counts, bad = _fresh_counts(root)
    assert counts == [50, 50, 50, 50] and bad == [], (counts, bad)


def test_a_file_named_by_check_is_left_out_of_the_digest_that_holds_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page that rots in place after its file was digested changes no identity: the
    digest still holds a good copy. Once `warehouse check` names the file, the views leave
    its rows out of the digest too, in every process: the same answer as reading it."""
    monkeypatch.setattr("warehouse.digest.MIN_FILES", 4)
    root = tmp_path / "wh"
    _record(root, 6, turns=3)
    with Warehouse(root).query() as q:  # builds the digests
        assert q.rows("SELECT count(*) FROM turns") == [(18,)]
    assert list((root / "_cache" / "turns" / "run_id=r1").glob("digest-*.parquet"))
    victim = sorted((root / "turns" / "run_id=r1").glob("*.parquet"))[2]
    _corrupt_column(victim, "assistant_content", keep_identity=True)

    # the digest serves its good copy: nobody knows yet (a fresh process builds no new
    # digest: all six files are covered)
    counts, bad = _fresh_counts(root)
    assert bad == [] and counts[0] == 18

    r = subprocess.run(
        [sys.executable, "-m", "sandflow.cli", "warehouse", "check", "-w", str(root)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert r.returncode == 1 and str(victim) in r.stderr, r.stdout + r.stderr

    counts, bad = _fresh_counts(root)
    assert counts == [15, 15, 15, 15] and bad == [str(victim)], (counts, bad)

    # quarantined: moved aside, the registry's entry no longer applies, nothing is bad
    r = subprocess.run(
        [sys.executable, "-m", "sandflow.cli", "warehouse", "check", "-w", str(root),
         "--quarantine"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert not victim.exists()
    counts, bad = _fresh_counts(root)
    assert counts == [15, 15, 15, 15] and bad == [], (counts, bad)


def test_the_registry_never_names_a_path_outside_the_warehouse(tmp_path: Path) -> None:
    from warehouse.badfiles import REGISTRY, prime

    root = tmp_path / "wh"
    _record(root, 1, turns=2)
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(b"PAR1" + b"x" * 20 + b"PAR1")
    st = outside.stat()
    ident = [st.st_size, st.st_mtime_ns, st.st_ino]
    entries = [{"path": "../outside.parquet", "identity": ident, "reason": "x"},
               {"path": str(outside), "identity": ident, "reason": "x"}]  # fmt: skip
    (root / REGISTRY).write_text(
        "".join(json.dumps(e) + "\n" for e in entries) + "not json\n", encoding="utf-8"
    )
    assert prime(root) == []
    with Warehouse(root).query() as q:
        assert q.rows("SELECT count(*) FROM turns") == [(2,)] and q.snapshot.bad == []


def test_check_judges_a_known_bad_file_again_and_forgets_a_passing_fault(tmp_path: Path) -> None:
    """A file recorded bad by a fault that passed (an I/O error while reading) stays out
    until `warehouse check` reads every page again and finds it sound."""
    from warehouse.badfiles import remember
    from warehouse.validate import BadFile

    root = tmp_path / "wh"
    _record(root, 3, turns=4)
    sound = sorted((root / "turns" / "run_id=r1").glob("*.parquet"))[0]
    remember(root, [BadFile(sound, "turns", "corrupt data pages: [Errno 5] Input/output error")])
    counts, bad = _fresh_counts(root)
    assert counts[:2] == [8, 8] and bad == [str(sound)]

    def check(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sandflow.cli", "warehouse", "check", "-w", str(root), *flags],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip

    r = check("--quick")  # footers only: what is known stays known
    assert r.returncode == 1 and str(sound) in r.stderr, r.stdout + r.stderr
    r = check()  # every page read again: sound
    assert r.returncode == 0 and "0 bad" in r.stdout, r.stdout + r.stderr
    counts, bad = _fresh_counts(root)
    assert counts[:2] == [12, 12] and bad == []
