"""Check data files before the views see them: one bad file must not sink a table.

DuckDB fails a whole multi-file scan on one truncated file ("No magic bytes") and
silently unions a foreign file's columns in. So every file is checked first:

1. magic bytes at both ends (cheap: catches truncated and non-Parquet files);
2. the footer's key-value metadata, read for all files in one DuckDB call
   (``parquet_kv_metadata``; if that fails, file by file with pyarrow to find the
   culprit): tagged ``sandflow.table=<this table>``, carrying its column list;
3. files without a column list (hand-made) get their schema read and key columns checked.

That reads footers only. A file whose header and footer are intact but whose data pages
are corrupt (a bad disk block, a torn copy) passes them and fails later, inside a query,
with an error that names no file. ``verify_data`` reads every page of every column chunk
(and checks the pages' CRC32 where the writer stored one: write_parquet_atomic does), so
`sandflow warehouse check` finds such files by name, and a query that fails on one learns
which file it was (``find_corrupt``) and leaves it out like any other bad file.

Bad files are left out and reported (path + reason); with quarantine they move to
``<root>/_quarantine/`` next to a ``.reason.txt``. Results are cached in the process per
file identity (path, size, mtime_ns, inode): the cache is looked up right after one
``stat``, before the file is opened, so re-validating an unchanged warehouse (the viewer's
refreshes of a live run) costs one stat per file; a file rewritten in place (new mtime or
size) or replaced by a rename (new inode) is a new identity and is checked again.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from warehouse.duck import open_duckdb
from warehouse.schema import (
    KEY_COLUMNS,
    META_COLUMNS,
    META_PROMPT_DELTAS,
    META_TABLE,
    META_VERSION,
)

MAGIC = b"PAR1"


@dataclass(frozen=True)
class BadFile:
    path: Path
    table: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class FileInfo:
    """What validation learned about a good file (the views group files by columns)."""

    path: Path
    columns: tuple[str, ...]
    schema_version: int
    prompt_deltas: bool = False  # turns: prompt ids stored as deltas (schema.META_PROMPT_DELTAS)
    # The version of the file that was judged (path, size, mtime_ns, inode): a reader
    # compares it after reading a file that can be renamed over (see changed_since).
    key: tuple[str, int, int, int] | None = field(default=None, compare=False)


class FilesVanished(RuntimeError):
    """Listed files disappeared before they were read (a concurrent compaction): re-list."""


_Key = tuple[str, int, int, int]  # (path, size, mtime_ns, inode): one version of one file
_cache: dict[_Key, FileInfo | str] = {}
_cache_lock = threading.Lock()
_VANISHED = "file vanished while reading (a concurrent compaction or re-record?)"


def file_key(path: Path) -> _Key | None:
    """The identity of the file now at `path` (None if there is none): what caches key on."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)


def _magic(path: Path, key: _Key | None = None) -> tuple[_Key | None, str | None]:
    key = key or file_key(path)
    if key is None:
        return None, _VANISHED
    size = key[1]
    if size < 12:
        return key, f"not a Parquet file: only {size} bytes (truncated or empty)"
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
            fh.seek(-4, os.SEEK_END)
            tail = fh.read(4)
    except FileNotFoundError:
        return None, _VANISHED
    except OSError as exc:
        return key, f"unreadable: {exc}"
    if head != MAGIC or tail != MAGIC:
        return key, "truncated or not a Parquet file (no PAR1 magic bytes at the start/end)"
    return key, None


def _judge(path: Path, table: str, kv: dict[bytes, bytes], key: _Key) -> FileInfo | str:
    tag = kv.get(META_TABLE)
    if tag is None:
        try:
            names = pq.read_schema(path).names
        except (OSError, pa.ArrowException):
            names = []
        return (
            "foreign schema: not written by the sandflow warehouse (no sandflow.table tag); "
            f"columns: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}"
        )
    if tag.decode() != table:
        return f"belongs to table {tag.decode()!r}, found under {table!r}"
    try:
        version = int(kv.get(META_VERSION, b"1"))
    except ValueError:
        version = 1
    cols = kv.get(META_COLUMNS)
    if cols:
        columns = tuple(cols.decode().split(","))
    else:
        try:
            columns = tuple(pq.read_schema(path).names)
        except (OSError, pa.ArrowException) as exc:
            return f"corrupt Parquet footer: {str(exc).splitlines()[0][:200]}"
    missing = [c for c in KEY_COLUMNS[table] if c not in columns]
    if missing:
        return f"foreign schema: key column(s) {', '.join(missing)} missing"
    return FileInfo(
        path=path,
        columns=columns,
        schema_version=version,
        prompt_deltas=kv.get(META_PROMPT_DELTAS) == b"1",
        key=key,
    )


def changed_since(infos: list[FileInfo]) -> list[Path]:
    """The files of `infos` that are no longer the version validation judged (renamed
    over by a re-record, or deleted). DuckDB opens a file by its path more than once per
    query (its footer at bind, its pages at scan), so a file renamed over meanwhile is
    read half old, half new: an error such as "TProtocolException: Invalid data", or
    rows that mix two versions. A reader that finds a changed file reads again."""
    return [i.path for i in infos if i.key is not None and file_key(i.path) != i.key]


def _kv_pyarrow(path: Path) -> dict[bytes, bytes] | str:
    try:
        return dict(pq.read_metadata(path).metadata or {})
    except FileNotFoundError:
        return _VANISHED
    except (OSError, pa.ArrowException) as exc:
        return f"corrupt Parquet footer: {str(exc).splitlines()[0][:200]}"


def _kv_many(paths: list[Path]) -> dict[Path, dict[bytes, bytes] | str]:
    """Footer metadata of many files in one DuckDB scan; per-file fallback on any error."""
    out: dict[Path, dict[bytes, bytes] | str] = {p: {} for p in paths}
    if len(paths) < 100:  # measured: pyarrow file by file wins below ~150 files (no DuckDB start)
        return {p: _kv_pyarrow(p) for p in paths}
    con = open_duckdb()
    try:
        lst = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"
        rows = con.execute(
            f"SELECT file_name, key, value FROM parquet_kv_metadata({lst})"
        ).fetchall()
    except duckdb.Error:
        return {p: _kv_pyarrow(p) for p in paths}
    finally:
        con.close()
    by_name = {str(p): p for p in paths}
    for fname, k, v in rows:
        p = by_name.get(fname)
        if p is not None:
            d = out[p]
            assert isinstance(d, dict)
            d[bytes(k)] = bytes(v)
    return out


def validate_files(
    files: list[Path], table: str, *, strict: bool = False
) -> tuple[list[FileInfo], list[BadFile]]:
    """Split `files` into good (with their columns) and bad (with a reason).

    A file that vanished since the listing is skipped, or with strict=True raises
    FilesVanished so the caller can take a fresh listing.
    """
    results: dict[Path, FileInfo | str] = {}
    todo: list[tuple[Path, _Key]] = []
    for p in files:
        key = file_key(p)
        if key is not None:
            with _cache_lock:
                hit = _cache.get(key)
            if hit is not None:  # this very version of the file was checked already
                results[p] = hit
                continue
        key, problem = _magic(p, key)
        if problem is not None:
            results[p] = problem
            if key is not None:
                _remember(key, problem)
            continue
        assert key is not None
        todo.append((p, key))
    if todo:
        kvs = _kv_many([p for p, _ in todo])
        for p, key in todo:
            kv = kvs[p]
            res: FileInfo | str = kv if isinstance(kv, str) else _judge(p, table, kv, key)
            results[p] = res
            if res != _VANISHED:
                _remember(key, res)
    good: list[FileInfo] = []
    bad: list[BadFile] = []
    for p in files:
        r = results[p]
        if isinstance(r, FileInfo):
            good.append(r)
        elif r == _VANISHED:
            if strict:
                raise FilesVanished(str(p))
        else:
            bad.append(BadFile(p, table, r))
    return good, bad


# ---- data pages ------------------------------------------------------------------------
_data_cache: dict[_Key, str | None] = {}
VERIFY_BATCH_ROWS = 2048  # rows decoded at a time: bounds memory on huge text columns


def verify_data(path: Path) -> str | None:
    """Decode every page of every column chunk of `path`; None if all decode, else why not.

    Streams each column in small batches (memory stays bounded on a compacted file with
    megabytes of text per row group) and verifies page checksums where present. Results
    are cached per file identity (path, size, mtime_ns, inode): an unchanged file is read
    once per process, a rewritten or replaced one again.
    """
    key = file_key(path)
    if key is None:
        return _VANISHED
    with _cache_lock:
        if key in _data_cache:
            return _data_cache[key]
    key, problem = _magic(path, key)
    if key is None:
        return _VANISHED
    if problem is None:
        problem = _decode_all(path)
    if problem != _VANISHED:
        with _cache_lock:
            if len(_data_cache) > 500_000:
                _data_cache.clear()
            _data_cache[key] = problem
        if problem is not None:
            _remember(key, problem)  # validate_files now leaves it out too
    return problem


def _decode_all(path: Path) -> str | None:
    """Both readers: pyarrow checks page CRCs (DuckDB silently reads some corrupt pages),
    DuckDB parses page headers its own way (pyarrow passes some it rejects)."""
    return _decode_pyarrow(path) or _decode_duckdb(path)


_verifier = threading.local()  # one DuckDB connection per verifying thread


def _verifier_connection() -> duckdb.DuckDBPyConnection:
    """The thread's own connection: opening one costs ~10 ms, more than reading a small
    file, and `warehouse check` reads tens of thousands of them."""
    con = getattr(_verifier, "con", None)
    if con is None:
        con = open_duckdb(threads=1)
        _verifier.con = con
    return con


def _decode_duckdb(path: Path) -> str | None:
    con = _verifier_connection()
    try:
        # hash of the whole row: every column chunk is read and decoded, nothing is kept
        con.execute(
            "SELECT bit_xor(hash(t)) FROM read_parquet(?, hive_partitioning = false) t",
            [str(path)],
        ).fetchall()
    except duckdb.Error as exc:
        _verifier.con = None  # a fresh connection after any failure
        con.close()
        if isinstance(exc, duckdb.IOException) and not path.exists():
            return _VANISHED
        return f"corrupt data pages: {_first(exc)}"
    return None


def _first(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


def _decode_pyarrow(path: Path) -> str | None:
    where = "the footer"
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        try:
            for name in pf.schema_arrow.names:
                where = f"column {name!r}"
                for _ in pf.iter_batches(
                    batch_size=VERIFY_BATCH_ROWS, columns=[name], use_threads=False
                ):
                    pass
        finally:
            pf.close()
    except FileNotFoundError:
        return _VANISHED
    except MemoryError:
        raise
    except Exception as exc:  # thrift, decompression, checksum, decoding: all mean corrupt
        return f"corrupt data pages in {where}: {_first(exc)}"
    return None


def verify_files(files: list[Path], table: str, *, threads: int | None = None) -> list[BadFile]:
    """`verify_data` over many files (in threads: pyarrow decodes without the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    if not files:
        return []
    workers = max(1, min(threads or (os.cpu_count() or 2), 8, len(files)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
        problems = list(pool.map(verify_data, files))
    return [
        BadFile(p, table, r)
        for p, r in zip(files, problems, strict=True)
        if r is not None and r != _VANISHED
    ]


def named_in(exc: BaseException, files: list[Path]) -> list[Path]:
    """Files of `files` that an error message names (DuckDB names some, not all)."""
    text = str(exc)
    return [p for p in files if str(p) in text]


def mark_bad(path: Path, reason: str) -> None:
    """Treat the file now at `path` as bad (warehouse.badfiles: found so by another
    session); validate_files leaves it out until it changes (a new identity)."""
    key = file_key(path)
    if key is not None:
        _remember(key, reason)
        with _cache_lock:
            _data_cache[key] = reason


def known_bad(key: _Key) -> str | None:
    """Why the file version `key` is bad, if this process knows it is."""
    with _cache_lock:
        hit = _cache.get(key)
    return hit if isinstance(hit, str) and hit != _VANISHED else None


def _remember(key: _Key, result: FileInfo | str) -> None:
    with _cache_lock:
        if len(_cache) > 500_000:
            _cache.clear()
        _cache[key] = result


def quarantine(bad: BadFile, root: Path) -> Path:
    """Move a bad file under <root>/_quarantine/, keeping its relative path, with a reason."""
    try:
        rel = bad.path.resolve().relative_to(root.resolve())
    except ValueError:
        rel = Path(bad.path.name)
    dest = root / "_quarantine" / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        dest = dest.with_name(f"{dest.stem}.{os.getpid()}{dest.suffix}")
    shutil.move(str(bad.path), dest)
    dest.with_name(dest.name + ".reason.txt").write_text(bad.reason + "\n", encoding="utf-8")
    return dest
