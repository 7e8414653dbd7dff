"""Temporary files of the warehouse: written under an flock, removed once nobody holds them.

Every data file is first written to a hidden temporary name in its final directory
(``.<name>.<random>.tmp``) and renamed when complete, so no listing or view ever sees a
half-written Parquet file (names starting with a dot and not ending in ``.parquet`` are
never listed: layout._file_ids). What a kill -9 in the middle of a write leaves behind
is such a temporary file: invisible, but it takes disk space and used to stay forever.

Whether its writer is still at work is a question the kernel answers, as for journals:
the writer holds an exclusive ``flock`` on the temporary file from its creation to its
rename (``locked_temp``). `remove_dead_temps` deletes a temporary file only if it can
take that lock itself, i.e. its writer is gone. The one race, a cleaner locking a file
its writer created a moment before locking it, is closed on the writer's side: after it
got the lock, the writer checks that its name still points at the file it locked, and
starts over under a new name if not.

Compaction's temporary files are written by DuckDB, which takes no flock; they are
removed only by a caller that holds the run's compaction lock (``compaction_locked``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
DUCKDB_TMP_PREFIX = ".duckdb-tmp-"


def is_temp_name(name: str) -> bool:
    """A warehouse temporary file: hidden and ending in .tmp."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def temp_name_for(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"


@contextlib.contextmanager
def locked_temp(dest: Path, *, text: bool = False) -> Iterator[tuple[Path, IO[Any]]]:
    """A new temporary file beside `dest`, open and flock'ed for the block.

    The caller writes it and renames it onto `dest` inside the block (the lock moves
    with the inode and is released when the file is closed). On an exception the file
    is removed.
    """
    for _ in range(10):
        tmp = temp_name_for(dest)
        fh = open(tmp, "x", encoding="utf-8") if text else open(tmp, "xb")  # noqa: SIM115
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                still_ours = os.stat(tmp).st_ino == os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                still_ours = False
        except BaseException:
            fh.close()
            raise
        if still_ours:
            break
        fh.close()  # a cleaner removed it between our create and our lock: new name
    else:  # pragma: no cover - needs a cleaner winning ten races in a row
        raise OSError(f"could not create a temporary file beside {dest}")
    try:
        yield tmp, fh
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        fh.close()


def remove_dead_temps(directory: Path, *, compaction_locked: bool = False) -> list[Path]:
    """Delete the temporary files in `directory` whose writer is gone; returns them.

    A file whose writer still holds its flock is left alone. DuckDB's compaction files
    (``.compacted-*.tmp``) and spill folders (``.duckdb-tmp-*``) carry no flock: they are
    removed only when the caller holds the run's compaction lock (`compaction_locked`).
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        path = Path(entry.path)
        if entry.name.startswith(DUCKDB_TMP_PREFIX) and entry.is_dir(follow_symlinks=False):
            if compaction_locked:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        if not is_temp_name(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        if entry.name.startswith(".compacted-"):
            if compaction_locked:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
            continue
        if _remove_if_unlocked(path):
            removed.append(path)
    for path in removed:
        log.info("warehouse: removed %s (left by a writer that died mid-write)", path)
    return removed


@contextlib.contextmanager
def try_flock(path: Path, *, shared: bool = False, nofollow: bool = False) -> Iterator[int | None]:
    """`path` opened read-only and flocked without waiting, for the block: the fd holding
    the lock, or None when another open file holds it (a live writer). Closing the fd
    at the end releases the lock. OSError from opening (FileNotFoundError: gone) is the
    caller's to catch. The warehouse's one way of asking "is its writer alive?" (temp
    files, journals, run locks)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0))
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)


def _remove_if_unlocked(path: Path) -> bool:
    try:
        with try_flock(path, nofollow=True) as fd:
            if fd is None:
                return False  # its writer is alive and at work
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    return False  # renamed over / replaced meanwhile: not the file we locked
            except FileNotFoundError:
                return False  # renamed onto its destination: finished, not ours to delete
            path.unlink()  # under our lock: a late writer sees its name gone and starts over
            return True
    except OSError:  # gone, a symlink, or unreadable: not a temp file of ours to remove
        return False
