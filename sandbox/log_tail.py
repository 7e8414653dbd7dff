"""What a shared, append-only log gained since a reader's cursor, read bounded.

The egress proxy's access log (sandbox/egress.py) and the firewall's refusal log
(sandbox/egress_firewall.py) are each written by one daemon for every sandbox of a host and
read turn by turn by each sandbox's episode. Both readers need the same care, so it lives
here once: read at most `max_bytes` from the cursor; stop at a line the daemon is still
writing; move the cursor only past lines logged before `since` (a reader's `since` only
moves forward, so those lines are never wanted again, while a later line may still be
wanted by a later turn whose window reaches it); start over from the top when the file
shrank under the cursor (it was replaced or rotated); never stall on one line longer than
the whole read: it is skipped (neither daemon writes one: squid bounds a logged URL at 8 KB,
the firewall's lines carry 128-byte header snaps: only a damaged file can have one).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def read_since(
    path: Path,
    start: int,
    *,
    since: float,
    parse: Callable[[bytes], T | None],
    time_of: Callable[[T], float],
    keep: Callable[[T], bool],
    max_bytes: int,
    max_records: int,
    from_line_start: bool = True,
) -> tuple[list[T], int]:
    """The records of `path`'s complete lines from byte `start` on that were logged at or
    after `since` and that `keep` accepts (at most `max_records`), and where the next read
    starts. `parse` gets one line (with its newline) and returns None for a line that is
    not a record. `from_line_start=False` says `start` may fall inside a line (a read of a
    log's last bytes without a cursor): the partial first line is skipped. An unreadable
    file reads as nothing, cursor unchanged."""
    try:
        size = path.stat().st_size
        if start > size:  # the file was replaced by a shorter one
            start, from_line_start = 0, True
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(max_bytes)
    except OSError:
        return [], start
    lines = data.splitlines(keepends=True)
    if not from_line_start and start > 0 and lines:
        skipped = lines.pop(0)
        if not skipped.endswith(b"\n"):
            return [], start  # no line starts in what was read
        start += len(skipped)
    if len(lines) == 1 and not lines[0].endswith(b"\n") and len(data) >= max_bytes:
        return [], start + len(lines[0])  # one line longer than a whole read: skipped
    out: list[T] = []
    pos, advance = start, True
    for raw in lines:
        if not raw.endswith(b"\n"):
            break  # the daemon is still writing this line
        rec = parse(raw)
        if rec is not None and time_of(rec) >= since:
            advance = False  # a later call (since only moves forward) may want this line
        if advance:
            pos += len(raw)
        if rec is None or time_of(rec) < since or not keep(rec):
            continue
        if len(out) < max_records:
            out.append(rec)
    return out, pos
