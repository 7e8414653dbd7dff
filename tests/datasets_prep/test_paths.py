"""Host paths named by data stay inside their folder: context_path reads and input folders.

Each case is an attack on `datasets_prep.paths` with real files, symlinks, hard links and
fifos on the real filesystem (no mocks): `..`, absolute paths, /proc/self/environ,
symlinks (absolute, relative, chains, to folders) leaving the folder, names that are not
UTF-8 or carry control characters, and a file swapped for a symlink after the check.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from datasets_prep import limits as limits_mod
from datasets_prep import paths as P
from datasets_prep.paths import InputFolderError, UnsafePathError, read_input_folder, read_inside


def set_limits(monkeypatch: pytest.MonkeyPatch, **kw: int) -> None:
    monkeypatch.setattr(limits_mod, "LIMITS", dataclasses.replace(limits_mod.LIMITS, **kw))


@pytest.fixture
def table_dir(tmp_path: Path) -> Path:
    """A table folder with a document, next to a secret outside it."""
    (tmp_path / "outside.txt").write_text("OUTSIDE SECRET")
    d = tmp_path / "table"
    (d / "docs").mkdir(parents=True)
    (d / "docs" / "a.txt").write_text("alpha")
    return d


# --------------------------------------------------------------------- read_inside
def test_reads_a_document_inside(table_dir: Path) -> None:
    assert read_inside(table_dir, "docs/a.txt") == b"alpha"
    assert read_inside(table_dir, "./docs/a.txt") == b"alpha"


@pytest.mark.parametrize(
    "name, says",
    [
        ("../outside.txt", "contains '..'"),
        ("docs/../../outside.txt", "contains '..'"),
        ("docs/../a.txt", "contains '..'"),  # even when it would stay inside: no '..' at all
        ("/etc/passwd", "is an absolute path"),
        ("/proc/self/environ", "is an absolute path"),
        ("", "empty"),
        ("a\x00b", "NUL"),
    ],
)
def test_escaping_names_are_refused(table_dir: Path, name: str, says: str) -> None:
    with pytest.raises(UnsafePathError, match=says):
        read_inside(table_dir, name)


def test_symlinks_leaving_the_folder_are_refused(table_dir: Path) -> None:
    outside = table_dir.parent / "outside.txt"
    (table_dir / "abs").symlink_to(outside)
    (table_dir / "rel").symlink_to("../outside.txt")
    (table_dir / "env").symlink_to("/proc/self/environ")
    (table_dir / "chain1").symlink_to("chain2")  # inside -> inside -> outside
    (table_dir / "chain2").symlink_to("docs/../../outside.txt")
    (table_dir / "updir").symlink_to(table_dir.parent)  # a folder symlink leaving
    for name in ("abs", "rel", "env", "chain1", "updir/outside.txt"):
        with pytest.raises(UnsafePathError, match="outside") as e:
            read_inside(table_dir, name)
        assert repr(name) in str(e.value) or f"'{name}'" in str(e.value)
        assert "OUTSIDE SECRET" not in str(e.value)


def test_symlinks_staying_inside_are_followed(table_dir: Path) -> None:
    (table_dir / "link").symlink_to("docs/a.txt")
    (table_dir / "dirlink").symlink_to("docs")
    assert read_inside(table_dir, "link") == b"alpha"
    assert read_inside(table_dir, "dirlink/a.txt") == b"alpha"


def test_the_table_folder_itself_may_be_a_symlink(table_dir: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(table_dir)
    assert read_inside(alias, "docs/a.txt") == b"alpha"
    with pytest.raises(UnsafePathError):
        read_inside(alias, "../outside.txt")


def test_special_files_and_missing_files(table_dir: Path) -> None:
    os.mkfifo(table_dir / "fifo")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        read_inside(table_dir, "fifo")  # refused without blocking on open
    with pytest.raises(UnsafePathError, match="does not exist"):
        read_inside(table_dir, "nope.txt")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        read_inside(table_dir, "docs")


def test_size_is_checked_before_reading(table_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(table_dir / "big.txt", "wb") as f:
        f.truncate(3 * 1024**3)  # sparse: nothing allocated
    with pytest.raises(UnsafePathError, match=r"'big.txt' is 3\.0 GB, over the limit .*SANDFLOW_MAX_FILE_BYTES"):
        read_inside(table_dir, "big.txt")


def test_a_file_swapped_for_a_symlink_after_the_check_is_not_followed(table_dir: Path) -> None:
    """TOCTOU: the checks passed on a regular file; then it became a symlink to a secret."""
    doc = table_dir / "docs" / "a.txt"
    st = os.stat(doc)
    real_root = os.path.realpath(table_dir)
    doc.unlink()
    doc.symlink_to(table_dir.parent / "outside.txt")
    with pytest.raises(UnsafePathError, match="cannot be opened safely"):
        P.open_regular(doc, root=real_root, expect=st)  # O_NOFOLLOW: ELOOP


def test_a_folder_swapped_for_a_symlink_after_the_check_is_caught_after_open(table_dir: Path) -> None:
    """TOCTOU one level up: docs/ becomes a symlink to the outside folder; the final
    component is a regular file there, so only the check of the opened fd catches it."""
    (table_dir.parent / "elsewhere").mkdir()
    (table_dir.parent / "elsewhere" / "a.txt").write_text("OUTSIDE SECRET")
    real_root = os.path.realpath(table_dir)
    st = os.stat(table_dir / "docs" / "a.txt")
    os.rename(table_dir / "docs", table_dir / "docs.old")
    (table_dir / "docs").symlink_to(table_dir.parent / "elsewhere")
    with pytest.raises(UnsafePathError, match="outside|replaced"):
        P.open_regular(table_dir / "docs" / "a.txt", root=real_root, expect=st)
    with pytest.raises(UnsafePathError, match="outside"):  # without the inode hint too
        P.open_regular(table_dir / "docs" / "a.txt", root=real_root)


def test_a_file_replaced_by_another_file_is_refused(table_dir: Path) -> None:
    doc = table_dir / "docs" / "a.txt"
    st = os.stat(doc)
    (table_dir / "docs" / "new").write_text("other")  # a new inode (unlink first could reuse it)
    os.replace(table_dir / "docs" / "new", doc)
    with pytest.raises(UnsafePathError, match="replaced"):
        P.open_regular(doc, root=os.path.realpath(table_dir), expect=st)


# ----------------------------------------------------------------- read_input_folder
@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha")
    (d / "sub" / "b.bin").write_bytes(b"\xff\x00\x01")
    return d


def test_input_folder_reads_text_and_bytes(folder: Path) -> None:
    got = read_input_folder(folder)
    assert got.files == {"a.txt": "alpha", "sub/b.bin": b"\xff\x00\x01"}
    assert got.skipped == [] and got.total_bytes == 8


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/environ", "../outside.txt", "/"])
def test_input_folder_symlink_leaving_is_refused_by_name(folder: Path, target: str) -> None:
    (folder.parent / "outside.txt").write_text("OUTSIDE SECRET")
    (folder / "sub" / "leak").symlink_to(target if not target.startswith("..") else "../../outside.txt")
    with pytest.raises(InputFolderError) as e:
        read_input_folder(folder)
    msg = str(e.value)
    assert "'sub/leak' is a symlink to" in msg and "outside the folder" in msg
    assert "nothing was started" in msg and "OUTSIDE SECRET" not in msg


def test_input_folder_lists_every_problem_at_once(folder: Path) -> None:
    (folder / "l1").symlink_to("/etc/passwd")
    (folder / "l2").symlink_to("/proc/self/environ")
    (folder / "dirleak").symlink_to("/etc")
    os.mkfifo(folder / "fifo")
    with pytest.raises(InputFolderError) as e:
        read_input_folder(folder)
    msg = str(e.value)
    for needle in ("'l1' is a symlink to '/etc/passwd'", "'l2' is a symlink to '/proc/",
                   "'dirleak' is a symlink to '/etc'", "'fifo' is a fifo"):
        assert needle in msg, msg


def test_input_folder_symlinks_inside_are_content_and_folder_links_are_skipped(folder: Path) -> None:
    (folder / "alias.txt").symlink_to("a.txt")
    (folder / "chain.txt").symlink_to("sub/../alias.txt")  # a chain that stays inside
    (folder / "loopdir").symlink_to(".")  # would loop forever if followed
    (folder / "subalias").symlink_to("sub")
    got = read_input_folder(folder)
    assert got.files["alias.txt"] == "alpha" and got.files["chain.txt"] == "alpha"
    assert "loopdir/a.txt" not in got.files and not any(k.startswith("subalias") for k in got.files)
    assert sorted(n for n, _ in got.skipped) == ["loopdir", "subalias"]


def test_input_folder_hard_link_is_the_file_itself(folder: Path) -> None:
    os.link(folder / "a.txt", folder / "hard.txt")
    assert read_input_folder(folder).files["hard.txt"] == "alpha"


def test_input_folder_symlink_loop_and_dangling_link(folder: Path) -> None:
    (folder / "x").symlink_to("y")
    (folder / "y").symlink_to("x")
    (folder / "dangling").symlink_to("missing.txt")
    with pytest.raises(InputFolderError) as e:
        read_input_folder(folder)
    assert "'x' is a symlink that cannot be followed" in str(e.value)
    assert "'dangling' is a symlink that cannot be followed" in str(e.value)


@pytest.mark.parametrize(
    "raw, shown",
    [
        (b"caf\xe9.txt", "'caf\\xe9.txt': the file name is not valid UTF-8"),
        (b"line\nbreak.txt", "'line\\x0abreak.txt': the file name contains the control character U+000A"),
        (b"esc\x1b[31m.txt", "the control character U+001B"),
        ("evil\u202etxt.exe".encode(), "the control character U+202E"),
    ],
)
def test_input_folder_bad_file_names_are_named(folder: Path, raw: bytes, shown: str) -> None:
    with open(os.path.join(os.fsencode(folder), raw), "wb") as f:
        f.write(b"x")
    with pytest.raises(InputFolderError) as e:
        read_input_folder(folder)
    assert shown in str(e.value)


def test_input_folder_size_and_count_limits(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_limits(monkeypatch, max_file_bytes=4)
    with pytest.raises(InputFolderError, match=r"'a.txt' is 5 B, over the limit of 4 B per file \(SANDFLOW_MAX_FILE_BYTES\)"):
        read_input_folder(folder)
    set_limits(monkeypatch, max_file_bytes=100, max_task_bytes=6)
    with pytest.raises(InputFolderError, match="SANDFLOW_MAX_TASK_BYTES"):
        read_input_folder(folder)
    set_limits(monkeypatch, max_task_bytes=100, max_files_per_task=1)
    with pytest.raises(InputFolderError, match="more than 1 files"):
        read_input_folder(folder)


def test_input_folder_in_folder_swap_after_the_scan(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan saw a regular file; before the read it became a symlink to /etc/passwd."""
    real_plan = P._plan

    def plan_then_swap(root: str, real_root: str):  # type: ignore[no-untyped-def]
        out = real_plan(root, real_root)
        (folder / "a.txt").unlink()
        (folder / "a.txt").symlink_to("/etc/passwd")
        return out

    monkeypatch.setattr(P, "_plan", plan_then_swap)
    with pytest.raises(InputFolderError, match="'a.txt'") as e:
        read_input_folder(folder)
    assert "root:" not in str(e.value)


def test_the_root_of_the_file_system_is_not_a_folder_of_its_own() -> None:
    """A table at /qa.csv would make 'etc/passwd' and 'proc/self/environ' "inside"."""
    with pytest.raises(UnsafePathError, match="root of the file system"):
        read_inside("/", "etc/passwd")
    with pytest.raises(UnsafePathError, match="root of the file system"):
        read_inside("/proc/..", "proc/self/environ")
    with pytest.raises(InputFolderError, match="root of the file system"):
        read_input_folder("/")
