"""What the read path caches, and why a cached answer is never a wrong one.

Two caches make an uncompacted warehouse (one file per episode per table) fast to open:

- validation results, in the process, per file identity (path, size, mtime_ns, inode):
  an unchanged file is not opened again; a file rewritten (new size or mtime) or replaced
  by a rename (new inode) is checked again;
- digests (warehouse/digest.py): one file holding the rows of many small files, with the
  identity of each; a listed file whose identity a digest recorded is read from it, any
  other file is read itself.

Real parts only: the warehouse writer, pyarrow, DuckDB, the CLI.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse
from warehouse.validate import validate_files


def _record(root: Path, n: int, *, answer: str = "42", turns: int = 3) -> None:
    with Warehouse(root).writer(durability="flush") as w:
        for k in range(n):
            ep, ts = make_episode("r1", f"t{k}", turns=turns, answer=answer)
            record(w, ep, ts)


def _corrupt_data_pages(path: Path) -> None:
    """Flip bytes between the header magic and the footer: both stay intact."""
    data = bytearray(path.read_bytes())
    end = len(data) - pq.read_metadata(path).serialized_size - 8
    for i in range(8, end, 29):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _counts(root: Path) -> tuple[int, int, set[str]]:
    """Episodes, turns and the distinct answers, as a fresh session sees them."""
    with Warehouse(root).query() as q:
        ((eps,),) = q.rows("SELECT count(*) FROM episodes")
        ((turns,),) = q.rows("SELECT count(*) FROM turns")
        answers = {a for (a,) in q.rows("SELECT DISTINCT answer FROM episodes")}
    return eps, turns, answers


def test_validation_is_cached_per_file_identity(tmp_path: Path) -> None:
    _record(tmp_path, 2)
    part = tmp_path / "turns" / "run_id=r1"
    a, b = sorted(part.glob("*.parquet"))
    good, bad = validate_files([a, b], "turns")
    assert len(good) == 2 and not bad

    # rewritten in place (new size and mtime): a new identity, checked again
    a_bytes = a.read_bytes()
    a.write_bytes(b"not parquet at all")
    _, bad = validate_files([a, b], "turns")
    assert [x.path for x in bad] == [a] and "magic bytes" in bad[0].reason
    a.write_bytes(a_bytes)
    assert validate_files([a], "turns")[1] == []

    # replaced by a rename with the very same size and mtime: the inode tells it apart
    st = b.stat()
    forged = tmp_path / "forged.parquet"
    forged.write_bytes(b"X" * st.st_size)
    os.utime(forged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(forged, b)
    _, bad = validate_files([b], "turns")
    assert [x.path for x in bad] == [b], "a replaced file was taken from the cache"


def test_a_page_that_rots_after_it_was_cached_as_good_is_still_named(tmp_path: Path) -> None:
    """The cache trusts an unchanged identity; a bad block does not change it. The query
    that trips over the rotten page still finds and names the file (issue #11)."""
    _record(tmp_path, 3)
    wh = Warehouse(tmp_path)
    with wh.query() as q:  # validated (and cached) as good
        assert q.rows("SELECT count(*) FROM turns") == [(9,)]
    victim = sorted((tmp_path / "turns" / "run_id=r1").glob("*.parquet"))[1]
    st = victim.stat()
    _corrupt_data_pages(victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # same identity as cached
    with wh.query() as q:
        assert q.rows("SELECT count(*) FROM turns WHERE length(assistant_content) > 0") == [(6,)]
        assert [x.path for x in q.snapshot.bad] == [victim]
        assert "corrupt data pages" in q.snapshot.bad[0].reason


@pytest.fixture
def small_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Digests from 4 uncovered files on (256 by default: tests stay small)."""
    monkeypatch.setattr("warehouse.digest.MIN_FILES", 4)


def _digests(root: Path, table: str) -> list[Path]:
    return sorted((root / "_cache" / table / "run_id=r1").glob("digest-*.parquet"))


def test_an_uncompacted_run_is_read_through_digests_that_are_never_wrong(
    tmp_path: Path, small_digests: None
) -> None:
    _record(tmp_path, 6)
    assert _counts(tmp_path) == (6, 18, {"42"})
    assert len(_digests(tmp_path, "episodes")) == 1 and len(_digests(tmp_path, "turns")) == 1
    with Warehouse(tmp_path).query() as q:  # every small file is served by the digests
        names = {f.path.name for f in q.snapshot.files["turns"]}
        assert len(names) == 1 and next(iter(names)).startswith("digest-")

    # re-recorded episodes (same episode file name, new inode; a new turns attempt) are
    # read from their new files: the digest's copies of the old ones are left out
    shutil.rmtree(tmp_path / "_journal", ignore_errors=True)
    with Warehouse(tmp_path).writer(durability="flush") as w:
        for k in (0, 1):
            ep, ts = make_episode("r1", f"t{k}", turns=5, answer="new")
            record(w, ep, ts)
    assert _counts(tmp_path) == (6, 4 * 3 + 2 * 5, {"42", "new"})
    with Warehouse(tmp_path).query() as q:  # not the old row and the new one
        assert q.rows("SELECT count(*) FROM _raw_episodes") == [(6,)]

    # after compaction the digests serve nothing: the views read the compacted files and
    # the next session that finds no other reader open deletes the digests
    Warehouse(tmp_path).compact("r1")
    assert _counts(tmp_path) == (6, 22, {"42", "new"})
    _counts(tmp_path)
    assert _digests(tmp_path, "episodes") == [] and _digests(tmp_path, "turns") == []


def test_a_file_rewritten_corrupt_after_it_was_digested_is_named(
    tmp_path: Path, small_digests: None
) -> None:
    _record(tmp_path, 6)
    assert _counts(tmp_path)[1] == 18  # digests built, every file cached as good
    victim = sorted((tmp_path / "turns" / "run_id=r1").glob("*.parquet"))[2]
    _corrupt_data_pages(victim)  # a new mtime: no longer the file the digest holds
    with Warehouse(tmp_path).query() as q:
        assert q.rows("SELECT count(*) FROM turns WHERE length(assistant_content) > 0") == [(15,)]
        assert [x.path for x in q.snapshot.bad] == [victim]
    from sandflow.cli import app

    r = CliRunner().invoke(app, ["warehouse", "check", "-w", str(tmp_path)])
    assert r.exit_code == 1 and victim.name in r.output and "corrupt data pages" in r.output


def test_a_corrupt_digest_is_left_out_and_its_files_are_read_themselves(
    tmp_path: Path, small_digests: None
) -> None:
    _record(tmp_path, 6)
    assert _counts(tmp_path) == (6, 18, {"42"})
    for table in ("episodes", "turns"):
        (digest,) = _digests(tmp_path, table)
        _corrupt_data_pages(digest)
    assert _counts(tmp_path) == (6, 18, {"42"})
    # and `warehouse check` reads the files themselves, never a digest: all sound
    from sandflow.cli import app

    r = CliRunner().invoke(app, ["warehouse", "check", "-w", str(tmp_path)])
    assert r.exit_code == 0 and "0 bad" in r.output, r.output
