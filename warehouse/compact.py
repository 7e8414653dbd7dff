"""compact(run_id): merge a run's small files into one file per table, atomically.

Why: one file per episode is what concurrent writers need, but every query then opens
thousands of footers. A finished run is merged into one file per table, sorted by
episode and turn (so DuckDB's min/max statistics prune well).

How it stays readable and idempotent throughout:

1. Snapshot the partition's visible files (turns before episodes: see `_compact_run`),
   remembering each file's identity (name, inode, mtime).
2. DuckDB merges them (out-of-core sort, current schema, superseded attempts and batches
   dropped) into a hidden temp file, renamed to ``compacted-<id>.parquet``: not yet
   visible, because no manifest names it.
3. One atomic rename of ``_compaction.json`` switches readers over: the inputs are hidden
   and the compacted file shown, in the same instant.
4. The inputs (and any left hidden by an earlier compaction) are deleted if no query
   session is open (layout.readers_idle; else the next compaction does it), each only if
   it is still the very file merged (same inode): a re-record that happened meanwhile
   wrote a new file under the old name, which stays and wins in the views (latest write).

A crash at any point leaves either the old state or the new one plus files to clean; the
next compaction finishes the cleanup. Concurrent compactions of one run are serialized by
an flock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from warehouse.badfiles import prime, verify_and_remember
from warehouse.duck import open_duckdb
from warehouse.layout import FileId, Layout, Manifest, fsync_dir, new_id
from warehouse.query import projected_source
from warehouse.schema import META_PROMPT_DELTAS, file_metadata, schema_for
from warehouse.tempfiles import DUCKDB_TMP_PREFIX
from warehouse.validate import BadFile, FileInfo, changed_since, validate_files

# Turns carry ~2 KB of text each: 8,192 rows (~20 MB) a row group, so reading one episode's
# turns (the viewer's episode page) decompresses one small row group (~0.1 s instead of ~1 s
# at 122,880 rows on a million turns). Not ROW_GROUP_SIZE_BYTES: on an order-preserving copy
# of per-episode files it cut a row group per file (10,000 groups, a 65 MB footer).
ROW_GROUP_ROWS = {"turns": 8192}
COMPACT_TABLES = ("turns", "episodes", "scores", "usage")  # turns before episodes
ORDER_BY = {
    "episodes": "episode_id",
    "turns": "episode_id, turn_index",
    "scores": "episode_id, verifier",
    "usage": "episode_id, turn_index, call_index, capability",
}


@dataclass
class CompactionResult:
    run_id: str
    files_before: dict[str, int] = field(default_factory=dict)
    rows_after: dict[str, int] = field(default_factory=dict)
    skipped_bad: list[BadFile] = field(default_factory=list)
    # Merged files still on disk (hidden) because a query session was open: the next
    # compaction of the run deletes them.
    pending_deletes: int = 0
    # Temporary files a writer killed mid-write had left (deleted before merging).
    removed_temps: list[Path] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.rows_after)


def _identity(path: Path) -> FileId | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (path.name, st.st_ino, st.st_mtime_ns)


def _sql_list(paths: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


_DEDUP = {
    "episodes": (
        "QUALIFY row_number() OVER (PARTITION BY episode_id "
        "ORDER BY written_at DESC, write_id DESC) = 1"
    ),
    # Drop turns of attempts older than the episode's current one; keep newer ones (an
    # attempt committing right now: the views decide by the episode row).
    "turns": (
        "WHERE s.write_id >= coalesce((SELECT k.write_id FROM kept_episodes k "
        "WHERE k.episode_id = s.episode_id), '')"
    ),
    "scores": "QUALIFY batch_id = max(batch_id) OVER (PARTITION BY episode_id, verifier)",
    "usage": "QUALIFY batch_id = max(batch_id) OVER (PARTITION BY episode_id, labeler)",
}


def _plan(table: str, infos: list[FileInfo], kept: dict[str, str]) -> str:
    """The SELECT producing the merged rows, sorted by episode (and turn).

    Fast path (a run's first compaction: only per-episode files, one shape): each file
    is one episode, already sorted by turn, and its attempt is in its name, so superseded
    attempts are dropped by name and the files are read in episode order: no sort, no
    join, a straight streaming copy. Otherwise DuckDB deduplicates and sorts.
    """
    small = all(not i.path.name.startswith("compacted-") for i in infos)
    one_shape = len({i.columns for i in infos}) == 1
    if table in ("episodes", "turns") and small and one_shape:
        chosen = []
        for i in infos:
            eid, _, rest = i.path.name.partition(".")
            wid = rest.removesuffix(".parquet") if table == "turns" else ""
            if table == "turns" and eid in kept and wid < kept[eid]:
                continue  # a superseded attempt
            chosen.append((eid, wid, i))
        if not chosen:  # every file is a superseded attempt: merge them into no rows
            return f"SELECT * FROM ({projected_source(table, infos)}) s WHERE false"
        chosen.sort(key=lambda c: (c[0], c[1]))
        return projected_source(table, [c[2] for c in chosen])
    src = projected_source(table, infos)
    return f"SELECT * FROM ({src}) s {_DEDUP[table]} ORDER BY {ORDER_BY[table]}"


def remove_dead_temps(layout: Layout, run_id: str) -> list[Path]:
    """Delete what writers of `run_id` killed mid-write left (the run flow calls it at its
    start, under the run's lock). DuckDB's compaction temporaries go too when no compaction
    of the run is running (its lock is free); otherwise the next compaction removes them."""
    lock_dir = layout.journal_dir(run_id)
    if not lock_dir.is_dir() and not any(
        layout.part_dir(t, run_id).is_dir() for t in COMPACT_TABLES
    ):
        return []
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / ".compact.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a compaction is at work: leave its files to it
            return layout.remove_dead_temps(run_id, compaction_locked=False)
        return layout.remove_dead_temps(run_id, compaction_locked=True)


def compact_run(
    layout: Layout, run_id: str, *, memory_limit: str = "2GB", threads: int | None = None
) -> CompactionResult:
    """Merge `run_id`'s files (see module doc). Safe to run while the run is writing."""
    result = CompactionResult(run_id=run_id)
    lock_dir = layout.journal_dir(run_id)
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / ".compact.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # What a compaction or writer killed mid-write left behind (invisible, but on disk).
        result.removed_temps = layout.remove_dead_temps(run_id, compaction_locked=True)
        tmp_dir = lock_dir / f"{DUCKDB_TMP_PREFIX}{new_id()}"  # spill files: this run's, removable
        con = open_duckdb(threads=threads)
        try:
            con.execute(f"SET memory_limit = '{memory_limit}'")
            con.execute(f"SET temp_directory = '{tmp_dir}'")
            # Keeps the fast path's episode order (files are read in the order listed).
            con.execute("SET preserve_insertion_order = true")
            _compact_run(layout, run_id, con, result)
            result.pending_deletes = sum(
                len(Manifest.read(layout.part_dir(t, run_id)).replaces) for t in COMPACT_TABLES
            )
        finally:
            con.close()
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return result


def _compact_run(
    layout: Layout, run_id: str, con: duckdb.DuckDBPyConnection, result: CompactionResult
) -> None:
    # Snapshot turns before episodes: a turns file is always written before its episode
    # file, so every turns attempt we miss here is newer than the episodes we see.
    snaps: dict[str, list[Path]] = {t: layout.partition_files(t, run_id) for t in COMPACT_TABLES}
    prime(layout.root)  # files found bad before stay out of the merge (warehouse.badfiles)
    # Each episode's current attempt, materialized now (the episode files may be deleted
    # before the turns are merged).
    ep_good, _ = validate_files(snaps["episodes"], "episodes")
    kept: dict[str, str] = {}
    for _ in range(2):
        source = (
            projected_source("episodes", ep_good)
            if ep_good
            else "SELECT NULL::VARCHAR AS episode_id, NULL::VARCHAR AS write_id, "
            "NULL::TIMESTAMPTZ AS written_at WHERE false"
        )
        try:
            con.execute(
                "CREATE OR REPLACE TEMP TABLE kept_episodes AS "
                f"SELECT episode_id, write_id FROM ({source}) {_DEDUP['episodes']}"
            )
        except duckdb.Error as exc:  # a file with corrupt data pages: find it, leave it out
            ep_good = _without_corrupt(layout.root, ep_good, "episodes", exc, result=None)
            continue
        kept = dict(con.execute("SELECT episode_id, write_id FROM kept_episodes").fetchall())
        break
    for table in ("episodes", "turns", "scores", "usage"):
        files = snaps[table]
        part = layout.part_dir(table, run_id)
        if not files or (len(files) == 1 and files[0].name.startswith("compacted-")):
            _remove_replaced(layout, part)  # leftovers an open session kept last time
            continue
        good_info, bad = validate_files(files, table)
        result.skipped_bad.extend(bad)
        merged = None
        for _ in range(3):
            if not good_info:
                break
            try:
                merged = _merge(con, table, part, good_info, kept)
            except duckdb.Error as exc:
                good_info = _without_corrupt(layout.root, good_info, table, exc, result)
                continue
            moved = set(changed_since(good_info))
            if not moved:
                break
            # Renamed over by a re-record while merged (maybe read half old, half new):
            # merge again without them; they stay visible, the newer write.
            (part / merged[0]).unlink(missing_ok=True)
            merged = None
            good_info = [i for i in good_info if i.path not in moved]
        if merged is None:
            continue
        name, count = merged
        good = [g.path for g in good_info]
        # the versions merged (validation's), not whatever is at their names by now
        ids: list[FileId] = []
        for g in good_info:
            fid = (g.path.name, g.key[3], g.key[2]) if g.key else _identity(g.path)
            if fid is not None:
                ids.append(fid)
        result.files_before[table] = len(good)
        result.rows_after[table] = count
        old = Manifest.read(part)
        new = Manifest(compacted=[name], replaces=list(old.replaces) + ids)
        new.write(part)  # the switch
        _remove_replaced(layout, part)


def _merge(
    con: duckdb.DuckDBPyConnection,
    table: str,
    part: Path,
    good_info: list[FileInfo],
    kept: dict[str, str],
) -> tuple[str, int]:
    """COPY the partition's good files into a new (not yet visible) compacted file."""
    select = _plan(table, good_info, kept)
    name = f"compacted-{new_id()}.parquet"
    tmp = part / f".{name}.tmp"
    kv = file_metadata(table, schema_for(table).names)
    if any(i.prompt_deltas for i in good_info):
        kv[META_PROMPT_DELTAS] = b"1"  # rows are copied as stored: deltas stay deltas
    meta = (
        "KV_METADATA {" + ", ".join(f"'{k.decode()}': '{v.decode()}'" for k, v in kv.items()) + "}"
    )
    try:
        ((count,),) = con.execute(
            f"COPY ({select}) TO '{tmp}' (FORMAT parquet, COMPRESSION zstd, "
            f"ROW_GROUP_SIZE {ROW_GROUP_ROWS.get(table, 122880)}, {meta})"
        ).fetchall()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, part / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return name, int(count)


def _without_corrupt(
    root: Path,
    infos: list[FileInfo],
    table: str,
    exc: duckdb.Error,
    result: CompactionResult | None,
) -> list[FileInfo]:
    """`infos` minus the files whose data pages do not decode (or that a re-record
    renamed over while they were read); re-raise `exc` if none.

    Header and footer were checked already; a file whose pages are corrupt fails only
    when DuckDB reads it, with an error that need not name it. Such files are left out
    of the merge (and stay on disk, visible as bad files), never deleted.
    """
    moved = set(changed_since(infos))
    if moved:  # renamed over by a re-record mid-read, not corrupt: leave them to the views
        return [i for i in infos if i.path not in moved]
    bad = verify_and_remember(root, [i.path for i in infos], table)
    if not bad:
        raise exc
    if result is not None:
        result.skipped_bad.extend(bad)
    gone = {b.path for b in bad}
    return [i for i in infos if i.path not in gone]


def _remove_replaced(layout: Layout, part: Path) -> None:
    """Delete the files the manifest hides, unless a query session is open (one may have
    listed them before the switch): then they stay hidden until the next compaction."""
    manifest = Manifest.read(part)
    if not manifest.replaces or not layout.readers_idle():
        return
    for fid in manifest.replaces:
        path = part / fid[0]
        if _identity(path) == fid:  # still the very file we merged, not a re-record
            path.unlink(missing_ok=True)
    manifest.replaces = [fid for fid in manifest.replaces if _identity(part / fid[0]) == fid]
    manifest.write(part)
    fsync_dir(part)
