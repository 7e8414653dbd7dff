"""Files across the boundary: binary round trips, copy in/out, and export escapes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from sandbox import Sandbox


@pytest.mark.parametrize("where", ["/testbed/big/nested/blob.bin", "/tmp/big/blob.bin"])
def test_big_binary_roundtrip(box: Sandbox, where: str) -> None:
    data = os.urandom(12 * 1024 * 1024) + b"\x00\xff\n\r'\"$(reboot)`"
    box.write_file(where, data)
    assert box.read_file(where) == data
    r = box.exec(f"sha256sum {where} | cut -d' ' -f1; stat -c %U {where}")
    digest, owner = r.stdout.split()
    assert digest == hashlib.sha256(data).hexdigest()
    assert owner == "sandbox"
    box.exec(f"rm -f {where}")


def test_write_text_relative_to_workdir_and_overwrite(box: Sandbox) -> None:
    box.write_file("notes/a.txt", "héllo\n")
    box.write_file("notes/a.txt", "second")
    assert box.exec("cat /testbed/notes/a.txt").stdout == "second"
    assert box.read_file("notes/a.txt") == b"second"


def test_read_file_follows_symlinks_inside_the_sandbox(box: Sandbox) -> None:
    box.exec("echo target > /tmp/real.txt && ln -sf /tmp/real.txt /testbed/link.txt")
    assert box.read_file("/testbed/link.txt") == b"target\n"


def test_file_errors_are_clear(box: Sandbox) -> None:
    with pytest.raises(FileNotFoundError, match="/testbed/missing"):
        box.read_file("/testbed/missing")
    with pytest.raises(PermissionError):
        box.write_file("/etc/evil.conf", "x")
    with pytest.raises(IsADirectoryError):
        box.read_file("/testbed")
    with pytest.raises(ValueError):
        box.write_file("/testbed/dir/", "x")


def test_read_file_says_permission_denied_naming_the_path(box: Sandbox) -> None:
    """An unreadable file, directly or through a symlink, is a PermissionError naming the
    path asked for and the file it leads to (was: "empty archive", a FileNotFoundError)."""
    box.exec(
        "echo s > /tmp/locked && chmod 000 /tmp/locked && ln -sf /tmp/locked /testbed/to-locked"
        " && ln -sf /etc/shadow /testbed/to-shadow && mkfifo /tmp/fifo-r"
    )
    with pytest.raises(PermissionError, match=r"^/tmp/locked: permission denied"):
        box.read_file("/tmp/locked")
    with pytest.raises(
        PermissionError, match=r"^/testbed/to-locked -> /tmp/locked: permission denied"
    ):
        box.read_file("to-locked")
    with pytest.raises(
        PermissionError, match=r"^/testbed/to-shadow -> /etc/shadow: permission denied"
    ):
        box.read_file("/testbed/to-shadow")
    with pytest.raises(OSError, match="^/tmp/fifo-r: not a regular file"):
        box.read_file("/tmp/fifo-r")
    with pytest.raises(FileNotFoundError, match="/testbed/dangling -> /testbed/nowhere"):
        box.exec("ln -sf nowhere /testbed/dangling")
        box.read_file("/testbed/dangling")
    box.exec(
        "rm -f /tmp/locked /tmp/fifo-r /testbed/to-locked /testbed/to-shadow /testbed/dangling"
    )


def test_copy_in_and_out(box: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "in"
    (src / "docs" / "deep").mkdir(parents=True)
    (src / "docs" / "a.txt").write_text("alpha")
    (src / "docs" / "deep" / "b.bin").write_bytes(bytes(range(256)))
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    os.symlink("/etc/passwd", src / "host-secret")  # a host symlink must not be followed
    box.copy_in(src, "/testbed/input")
    r = box.exec("cd /testbed/input && find . | sort && ./run.sh && cat docs/a.txt")
    assert r.stdout.split() == [
        ".",
        "./docs",
        "./docs/a.txt",
        "./docs/deep",
        "./docs/deep/b.bin",
        "./run.sh",
        "ran",
        "alpha",
    ]

    box.exec(
        "mkdir -p /testbed/output/sub && echo answer > /testbed/output/answer.txt && cp /testbed/input/docs/deep/b.bin /testbed/output/sub/"
    )
    out = tmp_path / "out"
    written = box.copy_out("/testbed/output", out)
    assert sorted(p.relative_to(out).as_posix() for p in written) == ["answer.txt", "sub/b.bin"]
    assert (out / "answer.txt").read_text() == "answer\n"
    assert (out / "sub" / "b.bin").read_bytes() == bytes(range(256))


def test_copy_out_never_writes_outside_the_host_folder(box: Sandbox, tmp_path: Path) -> None:
    box.exec(
        "rm -rf /testbed/evil && mkdir -p /testbed/evil && cd /testbed/evil && "
        "echo ok > good.txt && "
        "ln -s /etc/passwd passwd-link && "
        "ln -s /etc etc-dir && "
        "ln -s ../../../../../tmp/escape rel-link && "
        "mkfifo pipe && "
        "echo data > orig && ln orig hard && "
        "mkdir -p victim"
    )
    out = tmp_path / "export"
    outside = tmp_path / "outside"
    outside.mkdir()
    out.mkdir()
    # A pre-existing symlink on the host side must not be written through either.
    os.symlink(outside, out / "victim")
    files = box.copy_out("/testbed/evil", out)
    names = sorted(p.relative_to(out).as_posix() for p in files)
    assert names == ["good.txt", "hard", "orig"]  # hard links arrive as plain copies
    assert (out / "hard").read_text() == (out / "orig").read_text() == "data\n"
    skipped = dict(files.skipped)  # type: ignore[attr-defined]
    assert any("symlink" in why for why in skipped.values())
    assert any("fifo" in why for why in skipped.values())
    for p in out.rglob("*"):
        assert p.is_symlink() and p.name == "victim" or (p.is_file() and not p.is_symlink())
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_copy_out_respects_size_and_count_limits(box: Sandbox, tmp_path: Path) -> None:
    from sandbox.archive import CopyLimits

    box.exec(
        "rm -rf /testbed/many && mkdir -p /testbed/many && cd /testbed/many && for i in $(seq 1 20); do head -c 1000 /dev/zero > f$i; done"
    )
    old = box.copy_limits  # type: ignore[attr-defined]
    box.copy_limits = CopyLimits(max_bytes=5500, max_files=100)  # type: ignore[attr-defined]
    try:
        files = box.copy_out("/testbed/many", tmp_path / "m")
    finally:
        box.copy_limits = old  # type: ignore[attr-defined]
    assert len(files) == 5
    assert sum(p.stat().st_size for p in files) <= 5500
    assert files.skipped  # type: ignore[attr-defined]
