"""Where every file of the warehouse lives, and how a consistent set of files is listed.

    <root>/episodes/run_id=<id>/<episode_id>.parquet              one row per episode
    <root>/turns/run_id=<id>/<episode_id>.<write_id>.parquet      its turns, per attempt
    <root>/<table>/run_id=<id>/batch-<batch_id>.parquet           scores, usage
    <root>/runs/run_id=<id>/run.parquet                           one row per run
    <root>/<table>/run_id=<id>/compacted-<id>.parquet             after compact(run_id)
    <root>/<table>/run_id=<id>/_compaction.json                   which files it replaced
    <root>/_journal/run_id=<id>/<episode_id>.jsonl                 episodes in progress
    <root>/_quarantine/...                                        bad files moved aside

An episode's row has a deterministic file name, so re-recording replaces it (atomic
rename: a reader has the old file or the new one, never half of either). Its turns are
written first, under the attempt's ``write_id``; the episode row is the commit point and
names that write_id. The views show only the turns of each episode's current attempt, so a
reader never sees two attempts' turns or an attempt without its turns, and a re-record
after compaction wins over the compacted copy. Superseded attempts' turn files stay
(invisible) until the next compaction removes them.
Temporary files start with a dot and end in ``.tmp``: no ``*.parquet`` listing sees them.
Their writer holds an flock on them until the rename; one left by a writer that died is
deleted by the next run or compaction of its run (warehouse.tempfiles).

Compaction's switch is one atomic rename of ``_compaction.json``: files it names under
``replaces`` are hidden, and a ``compacted-*`` file is shown only when the manifest names
it. So a listing sees either the small files or the compacted one, never both, never none.
A query session reads episode (and run) files once, when it is opened (their names are
rewritten in place), and holds a shared ``.readers.lock``: compaction deletes the files it
replaced only while no session is open, so no file a session listed vanishes under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from warehouse.schema import TABLES, check_run_id
from warehouse.tempfiles import locked_temp, remove_dead_temps

MANIFEST = "_compaction.json"
READERS_LOCK = ".readers.lock"
JOURNAL_DIR = "_journal"
QUARANTINE_DIR = "_quarantine"
PARQUET_COMPRESSION = "zstd"
# Min/max statistics only where they prune (keys); text columns would just bloat footers.
_STAT_COLUMNS = ("run_id", "episode_id", "turn_index", "domain", "mode", "task_id", "verifier")
# Dictionary encoding only for repetitive short columns; trying it on 2 KB texts costs time.
_DICT_COLUMNS = (
    "run_id", "episode_id", "write_id", "finish_reason", "domain", "mode", "model",
    "termination", "verifier", "capability", "labeler", "tool", "batch_id", "status",
)  # fmt: skip


def new_id() -> str:
    """A time-ordered unique id: sorts by creation time, unique across processes."""
    import time

    return f"{time.time_ns():x}{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_parquet_atomic(table: pa.Table, dest: Path, *, durable: bool = True) -> Path:
    """Write `table` to a hidden temp file in dest's directory, fsync, rename onto `dest`.

    A reader globbing ``*.parquet`` sees the whole file or nothing: a crash mid-write
    leaves only a ``.tmp`` file, never a truncated Parquet file ("No magic bytes"); the
    temp file is flock'ed while written, so the next run or compaction of the partition
    can tell it is dead and delete it (warehouse.tempfiles). Pages carry a CRC32, which
    `sandflow warehouse check` verifies (validate.verify_data).
    """
    write_parquet_files_atomic([(table, dest)], durable=durable)
    return dest


def _write_parquet(table: pa.Table, fh: IO[bytes]) -> None:
    pq.write_table(
        table,
        fh,
        compression=PARQUET_COMPRESSION,
        row_group_size=128 * 1024,
        write_statistics=[c for c in _STAT_COLUMNS if c in table.column_names] or False,
        use_dictionary=[c for c in _DICT_COLUMNS if c in table.column_names] or False,
        write_page_checksum=True,
    )
    fh.flush()


_FSYNC_POOL: ThreadPoolExecutor | None = None
_FSYNC_POOL_LOCK = threading.Lock()


def fsync_all(fds: list[int]) -> None:
    """fsync several files at once: the disk's journal commits them together (one wait
    instead of one per file). The first is synced in this thread, the rest beside it."""
    global _FSYNC_POOL
    if len(fds) > 1:
        with _FSYNC_POOL_LOCK:
            if _FSYNC_POOL is None:
                _FSYNC_POOL = ThreadPoolExecutor(4, thread_name_prefix="warehouse-fsync")
            others = [_FSYNC_POOL.submit(os.fsync, fd) for fd in fds[1:]]
    else:
        others = []
    os.fsync(fds[0])
    for f in others:
        f.result()


def write_parquet_files_atomic(files: list[tuple[pa.Table, Path]], *, durable: bool = True) -> None:
    """Write several tables as write_parquet_atomic does, made visible in the given order.

    All temp files are written, then fsynced together (one wait for the disk instead of
    one per file), then renamed one by one in order, each rename made durable (its
    folder fsynced) before the next: a crash never keeps a later file without an
    earlier one.
    """
    with contextlib.ExitStack() as stack:
        temps = []
        for table, dest in files:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp, fh = stack.enter_context(locked_temp(dest))
            _write_parquet(table, fh)
            temps.append((tmp, fh, dest))
        if durable:
            fsync_all([fh.fileno() for _, fh, _ in temps])
        for tmp, _, dest in temps:
            os.replace(tmp, dest)
            if durable:
                fsync_dir(dest.parent)


def write_text_atomic(text: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with locked_temp(dest, text=True) as (tmp, fh):
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
        os.replace(tmp, dest)
    fsync_dir(dest.parent)


FileId = tuple[str, int, int]  # (name, inode, mtime_ns): a name may be reused later


@dataclass
class Manifest:
    """The compaction record of one table partition.

    ``replaces`` holds (name, inode, mtime_ns) of each merged file: an episode file
    re-recorded after compaction gets the same name but a new inode, so it stays visible.
    """

    compacted: list[str] = field(default_factory=list)  # visible compacted files
    replaces: list[FileId] = field(default_factory=list)  # hidden (merged) files

    @classmethod
    def read(cls, part_dir: Path) -> Manifest:
        path = part_dir / MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise WarehouseLayoutError(f"{path}: unreadable compaction manifest ({exc})") from exc
        return cls(
            compacted=list(data.get("compacted", [])),
            replaces=[(str(n), int(i), int(m)) for n, i, m in data.get("replaces", [])],
        )

    def write(self, part_dir: Path) -> None:
        body = {"compacted": self.compacted, "replaces": sorted(set(self.replaces))}
        write_text_atomic(json.dumps(body, indent=1), part_dir / MANIFEST)

    def visible(self, files: list[FileId]) -> list[str]:
        hidden = set(self.replaces)
        shown = set(self.compacted)
        return [
            f[0]
            for f in files
            if f not in hidden and (not f[0].startswith("compacted-") or f[0] in shown)
        ]


def file_id(entry: os.DirEntry[str]) -> FileId:
    st = entry.stat()
    return (entry.name, st.st_ino, st.st_mtime_ns)


class WarehouseLayoutError(RuntimeError):
    """The warehouse's directory structure is not what it should be."""


class Layout:
    """Paths of one warehouse root. Creating a Layout never touches the disk."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser()

    # ---- directories -------------------------------------------------------------------
    def table_dir(self, table: str) -> Path:
        if table not in TABLES:
            raise ValueError(f"unknown warehouse table {table!r}; tables: {', '.join(TABLES)}")
        return self.root / table

    def part_dir(self, table: str, run_id: str) -> Path:
        return self.table_dir(table) / f"run_id={check_run_id(run_id)}"

    def journal_dir(self, run_id: str) -> Path:
        return self.root / JOURNAL_DIR / f"run_id={check_run_id(run_id)}"

    def journal_path(self, run_id: str, episode_id: str) -> Path:
        return self.journal_dir(run_id) / f"{check_episode_id(episode_id)}.jsonl"

    def quarantine_dir(self) -> Path:
        return self.root / QUARANTINE_DIR

    # ---- file names --------------------------------------------------------------------
    def episode_file(self, run_id: str, episode_id: str) -> Path:
        """Deterministic: re-recording an episode replaces its row (atomic rename)."""
        return self.part_dir("episodes", run_id) / f"{check_episode_id(episode_id)}.parquet"

    def turns_file(self, run_id: str, episode_id: str, write_id: str) -> Path:
        """One file per recording attempt; the episode row says which attempt is current."""
        return self.part_dir("turns", run_id) / f"{check_episode_id(episode_id)}.{write_id}.parquet"

    def batch_file(self, table: str, run_id: str, batch_id: str) -> Path:
        return self.part_dir(table, run_id) / f"batch-{batch_id}.parquet"

    def run_file(self, run_id: str) -> Path:
        return self.part_dir("runs", run_id) / "run.parquet"

    # ---- listing -----------------------------------------------------------------------
    def run_ids(self, table: str | None = None) -> list[str]:
        """Run ids that have a partition in `table` (or in any table)."""
        tables = [table] if table else list(TABLES)
        found: set[str] = set()
        for t in tables:
            d = self.table_dir(t)
            if not d.is_dir():
                continue
            for entry in os.scandir(d):
                if entry.is_dir() and entry.name.startswith("run_id="):
                    found.add(entry.name[len("run_id=") :])
        return sorted(found)

    def partition_files(self, table: str, run_id: str) -> list[Path]:
        """The visible data files of one partition, as a consistent snapshot.

        The manifest is read before and after listing the directory; if a compaction
        switched in between, list again, so the result never mixes the two states.
        """
        part = self.part_dir(table, run_id)
        return [part / name for name, _ in self.partition_listing(table, run_id)]

    def partition_listing(self, table: str, run_id: str) -> list[tuple[str, tuple[int, int, int]]]:
        """partition_files as (name, (size, mtime_ns, inode)), from the listing's own stat:
        what the read path's caches key on, without a second stat per file."""
        part = self.part_dir(table, run_id)
        for _ in range(20):
            before = _manifest_stamp(part)
            sizes: dict[str, int] = {}
            try:
                files = _file_ids(part, sizes)
            except FileNotFoundError:
                return []
            manifest = Manifest.read(part)
            if _manifest_stamp(part) == before:
                ident = {n: (sizes[n], mtime, ino) for n, ino, mtime in files}
                return [(n, ident[n]) for n in manifest.visible(files)]
        raise WarehouseLayoutError(f"{part}: compaction kept changing the file set; try again")

    def table_files(self, table: str, run_id: str | None = None) -> list[Path]:
        runs = [run_id] if run_id else self.run_ids(table)
        files: list[Path] = []
        for r in runs:
            files.extend(self.partition_files(table, r))
        return files

    def journal_files(self, run_id: str | None = None) -> list[Path]:
        base = self.root / JOURNAL_DIR
        dirs = [self.journal_dir(run_id)] if run_id else sorted(base.glob("run_id=*"))
        out: list[Path] = []
        for d in dirs:
            if d.is_dir():
                out.extend(sorted(p for p in d.glob("*.jsonl") if not p.name.startswith(".")))
        return out

    # ---- temporary files ---------------------------------------------------------------
    def remove_dead_temps(self, run_id: str, *, compaction_locked: bool = False) -> list[Path]:
        """Delete the temporary files of `run_id` whose writer died mid-write (kill -9).

        Files still being written (their writer holds their flock) stay; DuckDB's
        compaction temporaries only go when the caller holds the run's compaction lock.
        See warehouse.tempfiles.
        """
        removed: list[Path] = []
        for table in TABLES:
            removed += remove_dead_temps(
                self.part_dir(table, run_id), compaction_locked=compaction_locked
            )
        removed += remove_dead_temps(self.journal_dir(run_id), compaction_locked=compaction_locked)
        return removed

    # ---- readers vs. compaction ----------------------------------------------------------
    def hold_readers_lock(self) -> int | None:
        """A shared lock a query session holds while open (released by os.close).

        A compaction deletes the files it merged only when no session is open, so a
        session never loses a file it listed; otherwise they stay, hidden, until the next
        compaction. None if the lock file cannot be opened (read-only warehouse).
        """
        path = self.root / READERS_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY)  # another user's warehouse: still lockable
            except OSError:
                return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def readers_idle(self) -> bool:
        """True if no query session is open now (new ones list the current manifest)."""
        try:
            fd = os.open(self.root / READERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    def manifest_stamps(self, table: str, run_ids: list[str]) -> list[tuple[int, int] | None]:
        """Identity of each partition's manifest: it changes whenever a compaction switches."""
        return [_manifest_stamp(self.part_dir(table, r)) for r in run_ids]


def _file_ids(part: Path, sizes: dict[str, int] | None = None) -> list[FileId]:
    """The partition's data files. One deleted between listing and stat is skipped: only a
    compaction deletes, after its manifest already hid the file (and a file replaced by a
    rename is stat'ed as the new one). `sizes` gets each file's size from the same stat."""
    out = []
    for e in os.scandir(part):
        if e.name.endswith(".parquet") and not e.name.startswith("."):
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            out.append((e.name, st.st_ino, st.st_mtime_ns))
            if sizes is not None:
                sizes[e.name] = st.st_size
    return sorted(out)


def _manifest_stamp(part: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(part / MANIFEST)
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_ino)


_EPISODE_ID_RE_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def check_episode_id(episode_id: str) -> str:
    """Episode ids become file names: no dots, slashes or spaces (write ids follow a dot)."""
    if (
        not isinstance(episode_id, str)
        or not episode_id
        or len(episode_id) > 128
        or not set(episode_id) <= _EPISODE_ID_RE_CHARS
        or episode_id.startswith(("compacted-", "batch-"))
    ):
        raise ValueError(
            f"invalid episode_id {episode_id!r}: use 1-128 characters from A-Z a-z 0-9 _ - "
            "(tasks.records.episode_key produces such ids)"
        )
    return episode_id
