"""safe_extract against archives no sandbox can produce through the engine (crafted tars)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from sandbox.archive import CopyLimits, safe_extract


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = 0o4755 if kind == tarfile.REGTYPE else 0o755  # setuid must not survive
    return info


def test_crafted_escapes_are_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    blob = _tar(
        [
            (_info("top", tarfile.DIRTYPE), None),
            (_info("top/ok.txt"), b"fine"),
            (_info("top/../../escape.txt"), b"evil"),
            (_info("/etc/cron.d/evil"), b"evil"),
            (_info("top/abs-link", tarfile.SYMTYPE, "/etc/passwd"), None),
            (_info("top/dev", tarfile.CHRTYPE), None),
            (_info("top/blk", tarfile.BLKTYPE), None),
            (_info("top/fifo", tarfile.FIFOTYPE), None),
            (_info("top/hard-outside", tarfile.LNKTYPE, "/etc/shadow"), None),
            (_info("top/dir-link", tarfile.SYMTYPE, "/"), None),
            (_info("top/dir-link/inside.txt"), b"through a symlink"),
        ]
    )
    files = safe_extract(blob, out, CopyLimits())
    assert [p.relative_to(out).as_posix() for p in files] == ["ok.txt", "dir-link/inside.txt"]
    assert (out / "dir-link").is_dir() and not (out / "dir-link").is_symlink()
    assert (out / "ok.txt").stat().st_mode & 0o7777 == 0o755  # setuid bit dropped
    reasons = dict(files.skipped)
    assert reasons["top/../../escape.txt"].startswith("absolute or '..'")
    assert reasons["/etc/cron.d/evil"].startswith("absolute or '..'")
    assert reasons["top/dev"] == reasons["top/blk"] == "device file"
    assert reasons["top/fifo"] == "fifo"
    assert reasons["top/hard-outside"].startswith("hard link")
    assert reasons["top/abs-link"].startswith("symlink")
    assert not (tmp_path / "escape.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_limits_bound_bytes_and_files(tmp_path: Path) -> None:
    blob = _tar(
        [(_info("top", tarfile.DIRTYPE), None)]
        + [(_info(f"top/f{i}"), b"x" * 100) for i in range(10)]
    )
    files = safe_extract(blob, tmp_path / "a", CopyLimits(max_bytes=350, max_files=100))
    assert len(files) == 3 and files.bytes_written == 300 and len(files.skipped) == 7
    files = safe_extract(blob, tmp_path / "b", CopyLimits(max_bytes=10_000, max_files=4))
    assert len(files) == 4 and len(files.skipped) == 6


def test_single_file_export_keeps_its_name(tmp_path: Path) -> None:
    files = safe_extract(_tar([(_info("answer.txt"), b"42")]), tmp_path, CopyLimits())
    assert files == [tmp_path / "answer.txt"] and (tmp_path / "answer.txt").read_bytes() == b"42"


def test_every_entry_counts_and_implicit_parents_too(tmp_path: Path) -> None:
    """Folders, links and the folders a deep name would create all spend the entry cap."""
    deep = "/".join(f"p{i}" for i in range(50))
    blob = _tar(
        [(_info("top", tarfile.DIRTYPE), None)]
        + [(_info(f"top/d{i}", tarfile.DIRTYPE), None) for i in range(5)]
        + [(_info("top/link", tarfile.SYMTYPE, "/etc"), None)]
        + [(_info(f"top/{deep}/f"), b"x")]
    )
    files = safe_extract(blob, tmp_path / "out", CopyLimits(max_files=10))
    dirs = [p for p in (tmp_path / "out").rglob("*") if p.is_dir()]
    assert len(dirs) <= 10 and list(files) == []
    s = files.summary
    assert s.dirs == 5 and s.skipped == {"symlink": 1, "over_count": 1}, s.as_dict()


def test_a_forged_metadata_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    import pytest

    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 3_500_000_000
    blob = info.tobuf(tarfile.USTAR_FORMAT) + b"\0" * 4096
    with pytest.raises(tarfile.ReadError, match="metadata header of 3500000000 bytes"):
        safe_extract(blob, tmp_path / "out", CopyLimits())


def test_names_in_the_summary_cannot_drive_a_terminal(tmp_path: Path) -> None:
    blob = _tar(
        [
            (_info("top", tarfile.DIRTYPE), None),
            (_info("top/\x1b[2Jevil\n", tarfile.FIFOTYPE), None),
        ]
    )
    files = safe_extract(blob, tmp_path / "out", CopyLimits())
    assert files.summary.examples == {"fifo": ["top/\\x1b[2Jevil\\n"]}
    assert "\x1b" not in files.summary.describe()
