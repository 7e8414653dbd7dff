"""Episode and task ids are data: the file names made from them stay in the output folder,
never collide, and a planted symlink is replaced, never written through."""

from __future__ import annotations

from pathlib import Path

import pytest

from interop.names import OutputPathError, atomic_open, inside, safe_name

HOSTILE = ["../../etc/passwd", "a/b", "a_b", ".hidden", "..", "", "x\x00y", "é" * 300, "C:\\win", "-rf", "a b"]


def test_safe_names_are_plain_and_unique() -> None:
    names = [safe_name(h, ".json") for h in HOSTILE]
    assert len(set(names)) == len(HOSTILE)
    for n in names:
        assert "/" not in n and "\x00" not in n and not n.startswith(".") and len(n) <= 100
        assert inside(Path("/tmp/out"), n).parent == Path("/tmp/out")
    assert safe_name("7f3a9c_ok-1.2") == "7f3a9c_ok-1.2"  # a safe id is kept as it is


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", "x\x00"])
def test_inside_refuses_names_that_leave(name: str, tmp_path: Path) -> None:
    with pytest.raises(OutputPathError):
        inside(tmp_path, name)


def test_a_planted_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "ep.json").symlink_to(target)
    with atomic_open(out, "ep.json") as f:
        f.write("{}")
    assert target.read_text() == "keep me"
    assert not (out / "ep.json").is_symlink() and (out / "ep.json").read_text() == "{}"
    assert [p.name for p in out.iterdir()] == ["ep.json"]  # no temporary file left
