"""The one cursor-advancing tail reader behind both egress logs (sandbox/log_tail.py): its
edges, on plain files (the proxy's and the firewall's readers are tested with their own
formats in test_egress.py and test_egress_firewall.py)."""

from __future__ import annotations

from pathlib import Path

from sandbox import log_tail


def _parse(raw: bytes) -> tuple[float, str] | None:
    """A line `<time> <word>` as a record; anything else is not one."""
    parts = raw.decode().split()
    try:
        return (float(parts[0]), parts[1]) if len(parts) == 2 else None
    except ValueError:
        return None


def _read(path: Path, start: int, since: float, **kw: object) -> tuple[list[str], int]:
    args: dict = {
        "since": since,
        "parse": _parse,
        "time_of": lambda r: r[0],
        "keep": lambda r: r[1] != "other",
        "max_bytes": 1 << 20,
        "max_records": 100,
        **kw,
    }
    recs, pos = log_tail.read_since(path, start, **args)
    return [w for _, w in recs], pos


def test_cursor_moves_only_past_lines_before_since_and_waits_for_a_half_line(
    tmp_path: Path,
) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"1 old\n2 other\n5 mine\njunk\n6 other\n7 mi")
    words, pos = _read(log, 0, since=3)
    assert words == ["mine"]  # not before `since`, not filtered out by `keep`
    assert pos == len(b"1 old\n2 other\n")  # "5 mine" may be wanted by a later turn
    with open(log, "ab") as f:
        f.write(b"ne\n")
    words, pos2 = _read(log, pos, since=6.5)
    assert words == ["mine"] and pos2 == log.stat().st_size - len(b"7 mine\n")


def test_a_read_from_inside_a_line_skips_the_cut_line(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"1 first\n2 second\n")
    words, pos = _read(log, 3, since=0, from_line_start=False)  # inside "1 first"
    assert words == ["second"] and pos == len(b"1 first\n")  # at the first whole line
    assert _read(log, 3, since=0)[0] == ["second"]  # from a cursor: "irst" is just no record


def test_a_replaced_file_is_read_from_the_top(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"1 new\n")
    assert _read(log, 10_000, since=0) == (["new"], 0)
    assert _read(log, 10_000, since=2) == ([], 6)


def test_a_line_longer_than_a_whole_read_is_skipped_not_waited_on(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"1 " + b"x" * 5000 + b"\n2 next\n")
    words, pos = _read(log, 0, since=0, max_bytes=1000)
    assert words == [] and pos == 1000  # the cursor moves: no reader stalls on it
    reads = 1
    while not words and reads < 10:  # the rest of the long line parses as nothing
        words, pos = _read(log, pos, since=0, max_bytes=1000)
        reads += 1
    assert words == ["next"] and reads == 6 and pos == log.stat().st_size - len(b"2 next\n")


def test_bounded_records_and_a_missing_file(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_bytes(b"".join(b"%d r\n" % i for i in range(50)))
    assert len(_read(log, 0, since=0, max_records=7)[0]) == 7
    assert _read(tmp_path / "gone", 42, since=0) == ([], 42)
