"""Digests: a reader's cache of an uncompacted run's small files, so it opens fast.

A run that was not compacted (still recording, killed before its end, `--no-compact`, a
long RL session) keeps one Parquet file per episode per table. DuckDB pays ~0.1 ms per
file to count rows and ~1 ms to read one, so 20,000 episodes cost seconds per query and
tens of seconds to open (the episode rows are read at open). A digest holds the rows of
many such files in one file:

    <root>/_cache/<table>/run_id=<run>/digest-<id>.parquet

Its rows are the covered files' rows, projected onto the table's schema, plus the name
of the file each row came from (``_digest_file``); its footer records each covered file's
identity (name -> size, mtime_ns, inode). A digest never decides what the views show: the
listing does (layout.partition_files, the compaction manifest, validation). A listed file
whose identity (name, size, mtime_ns, inode) a digest recorded is read from the digest;
any other file (new since, rewritten, replaced by a re-record's rename) is read itself.
Rows of covered files that are no longer listed (compacted, quarantined) or have changed
are filtered out. So a digest can be stale but never wrong, and deleting one only makes
the next open slower.

Readers build digests when a partition has at least `MIN_FILES` uncovered files (each
digest covers files no other does; more than `MAX_DIGESTS` are merged into one), written
atomically like every warehouse file; a read-only warehouse simply gets none. Compaction
makes a run's digests useless (it hides what they cover); a session that starts when no
other is open deletes the digests that serve nothing.

Integrity (issue #11): a file is digested only after its footer passed validation and
DuckDB read all its pages while copying; a file whose pages fail stays out of the digest
(and is found and named as before when a query reads it). A file that rots after it was
digested is served from the digest's good copy; `sandflow warehouse check` opens without
digests and reads every page of the real files. A corrupt digest is left out like any
bad file and its files are read themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from warehouse.badfiles import verify_and_remember
from warehouse.layout import _DICT_COLUMNS, _STAT_COLUMNS, PARQUET_COMPRESSION, new_id
from warehouse.schema import META_PROMPT_DELTAS, file_metadata, schema_for
from warehouse.tempfiles import locked_temp
from warehouse.validate import FileInfo, validate_files

log = logging.getLogger(__name__)

CACHE_DIR = "_cache"
DIGESTED_TABLES = ("episodes", "turns", "scores", "usage")
MIN_FILES = 256  # uncovered files in a partition before a digest is built
MAX_DIGESTS = 16  # digests of one partition before they are merged into one
META_COVERS = b"sandflow.digest_covers"  # {file name: [size, mtime_ns, inode]}
_ROW_GROUP_ROWS = 8192

Identity = tuple[int, int, int]  # size, mtime_ns, inode
# (table, files, with_filename) -> SQL reading them as the table's rows (query.projected_source)
Project = Callable[[str, list[FileInfo], bool], str]


@dataclass
class Digest:
    info: FileInfo
    covers: dict[str, Identity]  # file name -> identity recorded when it was digested


@dataclass
class PartitionRead:
    """How one partition's listed files are read: digests (with the names each must leave
    out) and the files read themselves."""

    digests: list[tuple[FileInfo, list[str]]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


def digest_dir(root: Path, table: str, run_id: str) -> Path:
    return root / CACHE_DIR / table / f"run_id={run_id}"


def _digest_files(d: Path) -> list[Path]:
    try:
        return sorted(
            Path(e.path)
            for e in os.scandir(d)
            if e.name.startswith("digest-") and e.name.endswith(".parquet")
        )
    except (FileNotFoundError, NotADirectoryError):
        return []


def _load(infos: list[FileInfo]) -> list[Digest]:
    """Each digest's covered files, from its footer (``sandflow.digest_covers``)."""
    out = []
    for info in infos:
        kv = pq.read_metadata(info.path).metadata or {}
        covers = json.loads(kv.get(META_COVERS, b"{}"))
        out.append(
            Digest(info, {str(n): (int(a), int(b), int(c)) for n, (a, b, c) in covers.items()})
        )
    return out


def plan_partition(
    project: Project,
    con: duckdb.DuckDBPyConnection,
    root: Path,
    table: str,
    run_id: str,
    part: Path,
    listed: list[tuple[str, Identity]],
    *,
    build: bool = True,
    remove_unused: bool = False,
) -> PartitionRead:
    """Split `listed` (a partition's visible files with their identities, from
    layout.partition_listing) into digest-served and read-themselves, building a digest
    first when enough files are uncovered (see the module doc)."""
    compacted = [part / n for n, _ in listed if n.startswith("compacted-")]
    now = {n: ident for n, ident in listed if not n.startswith("compacted-")}
    plan = PartitionRead(files=compacted)
    d = digest_dir(root, table, run_id)
    found = _digest_files(d)
    if len(now) < MIN_FILES and not found:
        plan.files += [part / n for n in now]
        return plan
    good, bad = validate_files(found, table)
    for b in bad:
        log.warning("warehouse: digest left out, its files are read themselves: %s", b)
    # Only digests of this very schema: one written by an older sandflow would show NULL
    # for a column its files have (they are read themselves and digested again).
    shape = (*schema_for(table).names, "_digest_file")
    digests = _safe_load([g for g in good if g.columns == shape])
    if remove_unused:
        for g in good:
            if g.columns != shape:
                with contextlib.suppress(OSError):
                    g.path.unlink()
    uncovered = _uncovered(digests, now)
    if build and (len(uncovered) >= MIN_FILES or len(digests) > MAX_DIGESTS):
        merge = digests if len(digests) > MAX_DIGESTS else []
        new = _build(project, con, root, table, run_id, [part / n for n in uncovered], merge, now)
        if new is not None:
            digests = [g for g in digests if g not in merge] + [new]
            uncovered = _uncovered(digests, now)
    claimed: set[str] = set()
    for dg in digests:
        mine = {n for n, ident in dg.covers.items() if now.get(n) == ident and n not in claimed}
        if not mine:
            if remove_unused:  # serves nothing (its run was compacted); no other reader is open
                with contextlib.suppress(OSError):
                    dg.info.path.unlink()
            continue
        claimed |= mine
        plan.digests.append((dg.info, sorted(set(dg.covers) - mine)))
    plan.files += [part / n for n in uncovered]
    return plan


def _uncovered(digests: list[Digest], now: dict[str, Identity]) -> list[str]:
    """Names in `now` whose identity no digest recorded (in `now`'s order)."""
    served: set[str] = set()
    for dg in digests:
        served.update(n for n, ident in dg.covers.items() if now.get(n) == ident)
    return [n for n in now if n not in served]


def _safe_load(infos: list[FileInfo]) -> list[Digest]:
    out = []
    for info in infos:
        try:
            out += _load([info])
        except (OSError, ValueError, TypeError, pa.ArrowException) as exc:
            log.warning("warehouse: digest %s left out (%s); its files are read themselves",
                        info.path, exc)  # fmt: skip
    return out


def _build(
    project: Project,
    con: duckdb.DuckDBPyConnection,
    root: Path,
    table: str,
    run_id: str,
    uncovered: list[Path],
    merge: list[Digest],
    now: dict[str, Identity],
) -> Digest | None:
    """Write one digest of `uncovered`'s good files (and the still-valid rows of `merge`)."""
    good, _ = validate_files(uncovered, table)  # bad files are named by the session itself
    idents = {i.path.name: now[i.path.name] for i in good if i.path.name in now}
    good = [i for i in good if i.path.name in idents]
    if not good and not merge:
        return None
    d = digest_dir(root, table, run_id)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only warehouse: no digests, the files are read themselves
    for _ in range(2):
        try:
            return _write(project, con, d, table, good, idents, merge, now)
        except (duckdb.Error, pa.ArrowException) as exc:  # a file whose pages do not decode
            bad = {b.path for b in verify_and_remember(root, [i.path for i in good], table)}
            if not bad:
                log.warning("warehouse: no digest for %s/%s: %s", table, run_id, exc)
                return None
            good = [i for i in good if i.path not in bad]  # the session names them
        except OSError as exc:
            log.info("warehouse: no digest for %s/%s: %s", table, run_id, exc)
            return None
    return None


def _write(
    project: Project,
    con: duckdb.DuckDBPyConnection,
    d: Path,
    table: str,
    good: list[FileInfo],
    idents: dict[str, Identity],
    merge: list[Digest],
    now: dict[str, Identity],
) -> Digest:
    """Stream the rows into a new digest with the warehouse's Parquet settings (zstd, page
    CRCs, statistics on the key columns): files are read in name order (episode order),
    so a digest's row groups prune by episode like a compacted file's."""
    names = schema_for(table).names
    cols = ", ".join(f'"{n}"' for n in names)
    parts = []
    if good:
        src = project(table, sorted(good, key=lambda i: i.path.name), True)
        parts.append(f"SELECT {cols}, parse_filename(filename) AS _digest_file FROM ({src})")
    covers = {i.path.name: idents[i.path.name] for i in good}
    for dg in merge:
        keep = sorted(n for n, ident in dg.covers.items() if now.get(n) == ident)
        if keep:
            lst = ", ".join("'" + _q(n) + "'" for n in keep)
            parts.append(
                f"SELECT {cols}, _digest_file FROM read_parquet('{_q(dg.info.path)}', "
                f"hive_partitioning = false) WHERE _digest_file IN ({lst})"
            )
            covers.update({n: dg.covers[n] for n in keep})
    if not parts:
        raise OSError("nothing left to digest")
    kv = file_metadata(table, [*names, "_digest_file"])
    kv[META_COVERS] = json.dumps(covers, separators=(",", ":")).encode()
    if any(i.prompt_deltas for i in good) or any(g.info.prompt_deltas for g in merge):
        kv[META_PROMPT_DELTAS] = b"1"
    dest = d / f"digest-{new_id()}.parquet"
    reader = con.sql(" UNION ALL ".join(parts)).to_arrow_reader(_ROW_GROUP_ROWS)
    schema = reader.schema.with_metadata(kv)  # DuckDB's types: what the views read back
    with locked_temp(dest) as (tmp, fh):
        with pq.ParquetWriter(
            fh,
            schema,
            compression=PARQUET_COMPRESSION,
            write_statistics=[c for c in _STAT_COLUMNS if c in names],
            use_dictionary=[c for c in _DICT_COLUMNS if c in names] or False,
            write_page_checksum=True,
        ) as w:
            buf: list[pa.RecordBatch] = []  # DuckDB hands out small batches (one per file)
            for batch in reader:
                buf.append(pa.RecordBatch.from_arrays(batch.columns, schema=schema))
                if sum(b.num_rows for b in buf) >= _ROW_GROUP_ROWS:
                    w.write_table(pa.Table.from_batches(buf), row_group_size=_ROW_GROUP_ROWS)
                    buf = []
            if buf:
                w.write_table(pa.Table.from_batches(buf), row_group_size=_ROW_GROUP_ROWS)
        fh.flush()
        os.replace(tmp, dest)
    for dg in merge:
        with contextlib.suppress(OSError):
            dg.info.path.unlink()  # a session still reading it re-lists (FilesVanished)
    (info,), _ = validate_files([dest], table)
    log.info("warehouse: digest %s covers %d file(s)", dest, len(covers))
    return Digest(info, covers)


def _q(p: Path | str) -> str:
    return str(p).replace("'", "''")
