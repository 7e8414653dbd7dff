"""Files known to be bad, remembered in the warehouse so that every reader agrees.

A file whose header and footer are intact but whose data pages are corrupt passes the
footer checks every session makes when it opens; it shows only when a query decodes the
damaged pages. Without a memory of it, the same warehouse gave different counts depending
on which columns a query read and on whether this process had met the file before
(issue #22.4: 50 turns, then 0, then 50 again in the next process). So once a file is
found bad (by a query, a compaction, a digest build or `sandflow warehouse check`) its
identity and reason are written to ``<root>/_bad_files.jsonl``, and every session primes
its validation cache from there before it lists files: the file is left out of every
view and table, digests included, and named in ``snapshot.bad``, in every process.

An entry holds the file's identity (path relative to the root, size, mtime_ns, inode),
so it stops applying by itself when the file is repaired (rewritten: a new identity) or
quarantined (moved away). A read-only warehouse gets no entries (each process then
still leaves the file out once it found it). The registry is the warehouse's own data,
but it is still read defensively: bounded in size, and no entry may name a path outside
the root.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from warehouse.validate import BadFile, file_key, mark_bad, verify_files

log = logging.getLogger(__name__)

REGISTRY = "_bad_files.jsonl"
MAX_REGISTRY_BYTES = 16 * 1024 * 1024  # far beyond any real list; a larger file is ignored
MAX_REASON = 500


def registry_path(root: Path) -> Path:
    return root / REGISTRY


def _inside(root: Path, rel: str) -> Path | None:
    """`root / rel` if it stays inside `root` (no absolute path, no `..`)."""
    if not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        return None
    return root / rel


def _read(root: Path) -> list[dict[str, object]]:
    path = registry_path(root)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_REGISTRY_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        log.warning("warehouse: cannot read %s: %s", path, exc)
        return []
    if len(data) > MAX_REGISTRY_BYTES:
        log.warning("warehouse: %s is over %d bytes; ignored", path, MAX_REGISTRY_BYTES)
        return []
    entries = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if isinstance(e, dict) and isinstance(e.get("path"), str):
                entries.append(e)
    return entries


def _current(root: Path, entry: dict[str, object]) -> tuple[Path, str] | None:
    """(path, reason) if the entry still describes the file now at its path."""
    path = _inside(root, str(entry["path"]))
    if path is None:
        return None
    key = file_key(path)
    if key is None or list(key[1:]) != entry.get("identity"):
        return None
    return path, str(entry.get("reason") or "known bad")[:MAX_REASON]


def prime(root: Path) -> list[BadFile]:
    """Mark every file the registry names, unchanged since, as bad in this process's
    validation cache (validate_files then leaves it out). Returns them."""
    out = []
    for entry in _read(root):
        cur = _current(root, entry)
        if cur is not None:
            mark_bad(cur[0], cur[1])
            out.append(BadFile(cur[0], str(entry.get("table") or ""), cur[1]))
    return out


def remember(root: Path, bad: Iterable[BadFile]) -> None:
    """Add `bad` to the registry (dropping entries that no longer apply), under a lock:
    concurrent sessions each add what they found and lose nothing."""
    settle(root, [], bad)


def settle(root: Path, checked: Iterable[Path], bad: Iterable[BadFile]) -> None:
    """Record `bad`, and forget the entries of `checked` files that are not in it: every
    page of those was read again just now (`sandflow warehouse check`), so a file once
    judged bad by a passing fault (an I/O error) is counted again."""
    root = Path(root)
    bad = list(bad)
    found = {b.path for b in bad}
    checked = set(checked) - found
    new = []
    for b in bad:
        try:
            rel = b.path.resolve().relative_to(root.resolve())
        except ValueError:
            continue  # not a file of this warehouse
        key = file_key(b.path)
        if key is not None:
            new.append(
                {"path": str(rel), "identity": list(key[1:]), "table": b.table,
                 "reason": b.reason[:MAX_REASON]}  # fmt: skip
            )
    path = registry_path(root)
    if not new and not (checked and path.exists()):
        return
    try:
        lock = os.open(root / (REGISTRY + ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:  # a read-only warehouse: this process still leaves them out
        log.info("warehouse: cannot record bad files in %s: %s", path, exc)
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(root)
        keep = [
            e
            for e in entries
            if _inside(root, str(e["path"])) not in checked and _current(root, e) is not None
        ]
        if not new and len(keep) == len(entries):
            return  # nothing to forget
        names = {e["path"] for e in new}
        lines = [e for e in keep if e["path"] not in names] + new
        tmp = path.with_name(f".{REGISTRY}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in lines), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.info("warehouse: cannot record bad files in %s: %s", path, exc)
    finally:
        os.close(lock)


def verify_and_remember(root: Path, files: list[Path], table: str) -> list[BadFile]:
    """validate.verify_files, and what it finds goes into the registry."""
    found = verify_files(files, table)
    remember(root, found)
    return found
