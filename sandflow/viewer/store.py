"""The viewer's window on the warehouse: one locked-down query connection, kept fresh.

Why one long-lived connection and not one per request: opening a `WarehouseQuery` lists
and validates every file and pins the episode rows (about a second on a million turns
left uncompacted), while the pages' own queries take milliseconds. So the viewer keeps a
snapshot and replaces it when the warehouse changed:

- On each request, at most every `refresh_s`, a cheap fingerprint (the mtimes of the
  partition and journal folders, the sizes of the journals: a few `stat` calls, never a
  file listing of a big partition) tells whether anything was written. If so, a new
  snapshot is built in a background thread while pages keep being served from the old
  one; it is swapped in when ready. Rebuilds are spaced by at least five times the last
  build's duration, so a huge warehouse under a live run is not rebuilt back to back.
- A snapshot holds the warehouse's shared readers lock (compaction deletes merged files
  only while no reader is open), so after `idle_close_s` without a request it is closed,
  and the next request opens a fresh one.

DuckDB connections are not for concurrent use, so every query runs under one lock; the
SQL box's queries are bounded in time (DuckDB's interrupt) and in rows fetched. Every
value leaving here is scrubbed of secrets (datasets_prep.secrets: API keys are never
recorded; this is the second line of defence).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from datasets_prep import secrets as wsecrets
from sandflow.viewer.readonly import check_read_only, lock_down
from warehouse.query import (
    WarehouseQuery,
    WarehouseQueryError,
    first_line,
    projected_source,
    reread_changed,
)
from warehouse.schema import TABLES

log = logging.getLogger(__name__)

JOURNAL_DIR = "_journal"


@dataclass
class Result:
    """Rows of one query, secrets masked."""

    columns: list[str]
    rows: list[dict[str, Any]]
    truncated: bool = False  # more rows existed than were fetched
    seconds: float = 0.0


@dataclass(frozen=True)
class BadFile:
    """A file the snapshot left out: its path is shown whole (never cut, even under a
    long TMPDIR or clone path, or the user cannot find it); only the reason may be cut."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class SnapshotInfo:
    version: int = 0
    built_at: float = 0.0
    build_s: float = 0.0
    bad_files: list[BadFile] = field(default_factory=list)
    journal_problems: list[str] = field(default_factory=list)


def fingerprint(root: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes whenever the warehouse gets a file, a rename or a journal line.

    Folders' mtimes change when an entry is created, renamed or deleted in them (episode
    files are replaced by rename, turns and batches are new files, compaction renames its
    manifest); journals grow in place, so their sizes count too.
    """
    out: list[tuple[str, int, int]] = []

    def add(p: Path) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            st = os.stat(p)
            out.append((str(p), st.st_mtime_ns, st.st_size))

    for table in TABLES:
        tdir = root / table
        add(tdir)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for e in os.scandir(tdir):
                if e.name.startswith("run_id="):
                    add(Path(e.path))
    jdir = root / JOURNAL_DIR
    add(jdir)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for e in os.scandir(jdir):
            if not e.name.startswith("run_id="):
                continue
            add(Path(e.path))
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for j in os.scandir(e.path):
                    if j.name.endswith(".jsonl") or j.is_dir():
                        add(Path(j.path))
    return tuple(out)


def secret_values() -> list[str]:
    """The secret values to mask (from the environment), computed once per query."""
    return list(wsecrets._secret_values())


def clean(value: Any, values: list[str]) -> Any:
    """`value` with secret values masked (strings, and inside lists and dicts)."""
    if isinstance(value, str):
        return wsecrets.mask_text(value, values)
    if isinstance(value, dict | list | tuple):
        return wsecrets.scrub(value, values)
    return value


def clean_row(columns: Sequence[str], row: Sequence[Any], values: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in zip(columns, row, strict=True):
        if v is not None and wsecrets.is_secret_name(name):
            out[name] = wsecrets.MASK
        else:
            out[name] = clean(v, values)
    return out


class LiveWarehouse:
    """A read-only, self-refreshing query snapshot of the warehouse at `root`."""

    def __init__(
        self,
        root: Path | str,
        *,
        refresh_s: float = 2.0,
        idle_close_s: float = 600.0,
        sql_timeout_s: float = 15.0,
        threads: int | None = None,
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        self.refresh_s = refresh_s
        self.idle_close_s = idle_close_s
        self.sql_timeout_s = sql_timeout_s
        self.threads = threads
        self._q: WarehouseQuery | None = None
        self._lock = threading.RLock()  # guards the connection and the swap
        self._fp: tuple[tuple[str, int, int], ...] | None = None
        self._last_check = 0.0
        self._last_used = time.monotonic()
        self._refreshing = threading.Lock()  # held by the one rebuild in flight
        self._next_build_ok = 0.0
        self.info = SnapshotInfo()
        self._turn_files: dict[tuple[str, str], Any] | None = None  # per snapshot
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    def open(self) -> None:
        """Build the first snapshot now (raises WarehouseNotFound for a missing root)."""
        with self._lock:
            if self._q is None:
                self._swap(*self._build())
        if self._reaper is None and self.idle_close_s > 0:
            self._reaper = threading.Thread(target=self._reap, name="viewer-idle", daemon=True)
            self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._q is not None:
                self._q.close()
                self._q = None

    def _build(self) -> tuple[WarehouseQuery, tuple[tuple[str, int, int], ...], float]:
        fp = fingerprint(self.root)  # taken before listing: a change during the build shows
        t = time.perf_counter()
        q = WarehouseQuery(self.root, threads=self.threads)
        try:
            lock_down(q)
        except BaseException:
            q.close()
            raise
        return q, fp, time.perf_counter() - t

    def _swap(
        self, q: WarehouseQuery, fp: tuple[tuple[str, int, int], ...], build_s: float
    ) -> None:
        with self._lock:
            old, self._q = self._q, q
            self._fp = fp
            self._turn_files = None
            self.info = SnapshotInfo(
                version=self.info.version + 1,
                built_at=time.time(),
                build_s=build_s,
                bad_files=[BadFile(str(b.path), str(b.reason)) for b in q.snapshot.bad],
                journal_problems=list(q.snapshot.journal_problems),
            )
            self._next_build_ok = time.monotonic() + max(self.refresh_s, 5 * build_s)
            if old is not None:
                old.close()

    def _background_refresh(self) -> None:
        try:
            self._swap(*self._build())
        except Exception as exc:  # keep serving the old snapshot; say why in the log
            log.warning("viewer: refreshing the warehouse snapshot failed: %s", exc)
            self._next_build_ok = time.monotonic() + max(self.refresh_s, 10.0)
        finally:
            self._refreshing.release()

    def touch(self) -> None:
        """Called per request: reopen after an idle close; refresh if the warehouse changed."""
        now = time.monotonic()
        self._last_used = now
        if self._q is None:
            self.open()
            return
        if now - self._last_check < self.refresh_s or now < self._next_build_ok:
            return
        self._last_check = now
        if fingerprint(self.root) == self._fp:
            return
        if self._refreshing.acquire(blocking=False):
            threading.Thread(
                target=self._background_refresh, name="viewer-refresh", daemon=True
            ).start()

    def refresh_now(self) -> None:
        """Rebuild synchronously (after a file vanished under a query)."""
        with self._refreshing:
            self._swap(*self._build())

    def _reap(self) -> None:
        while not self._stop.wait(min(30.0, max(1.0, self.idle_close_s / 4))):
            if time.monotonic() - self._last_used < self.idle_close_s:
                continue
            with self._lock:
                if self._q is not None and time.monotonic() - self._last_used >= self.idle_close_s:
                    self._q.close()
                    self._q = None
                    log.info("viewer: idle, snapshot closed (readers lock released)")

    # ---- querying ----------------------------------------------------------------------
    def fetch(
        self,
        sql: str | Callable[[], str],
        params: Sequence[Any] | None = None,
        *,
        limit: int | None = None,
        timeout_s: float | None = None,
    ) -> Result:
        """Run the viewer's own (parameterised) SQL; rows as dicts, secrets masked.

        As `sandflow sql` does: a file that vanished under a compaction, or whose data pages
        turn out not to decode, is left out (the page's banner names it) and the query runs
        again on a rebuilt snapshot, instead of failing the page. `sql` may be a function
        that builds the query from the current snapshot (one naming a file directly is
        built again after that file was left out)."""
        return reread_changed(
            lambda: self._fetch(sql() if callable(sql) else sql, params, limit, timeout_s),
            attempts=3,
            renew=self.refresh_now,  # the rebuilt snapshot lists the files as they are now
            leave_out=self._leave_out_corrupt,
            other=lambda exc: exc,  # the SQL's own error (user_sql words it), a timeout
        )

    def _leave_out_corrupt(self, exc: duckdb.Error) -> bool:
        """Find the file(s) behind `exc` whose pages do not decode (validate's cache marks
        them bad, so the next snapshot leaves them out); True if any was found."""
        with self._lock:
            q = self._q
            return q is not None and q.leave_out_corrupt(exc)

    def user_sql(self, sql: str, *, limit: int) -> Result:
        """A query typed into the SQL box: one SELECT, bounded in time and rows."""
        text = check_read_only(sql)
        try:
            return self.fetch(text, limit=limit, timeout_s=self.sql_timeout_s)
        except duckdb.InterruptException:
            raise WarehouseQueryError(
                f"query stopped after {self.sql_timeout_s:g} s (the viewer's limit, "
                "`sandflow view --sql-timeout`); `sandflow sql` has none"
            ) from None
        except duckdb.Error as exc:
            raise WarehouseQueryError(
                f"SQL error ({type(exc).__name__}): {first_line(exc)}"
            ) from None

    def _fetch(
        self, sql: str, params: Sequence[Any] | None, limit: int | None, timeout_s: float | None
    ) -> Result:
        if self._q is None:
            self.open()
        values = secret_values()
        t = time.perf_counter()
        with self._lock:
            q = self._q
            assert q is not None
            timer = None
            if timeout_s:
                timer = threading.Timer(timeout_s, q.con.interrupt)
                timer.daemon = True
                timer.start()
            try:
                cur = q.con.execute(sql, list(params) if params else None)
                if cur.description is None:
                    return Result([], [], False, time.perf_counter() - t)
                columns = _unique([d[0] for d in cur.description])
                raw = cur.fetchmany(limit + 1) if limit is not None else cur.fetchall()
            finally:
                if timer is not None:
                    timer.cancel()
        truncated = limit is not None and len(raw) > limit
        if truncated:
            raw = raw[:limit]
        rows = [clean_row(columns, r, values) for r in raw]
        return Result(columns, rows, truncated, time.perf_counter() - t)

    def episode_turns_source(self, run_id: str, episode_id: str, write_id: str) -> str | None:
        """SQL reading just this attempt's own turns file, if the snapshot has one.

        Before a run is compacted each episode attempt has its own file; the `turns` view
        unions thousands of them, and a filter on one episode still opens every footer
        (seconds on a million turns). The file name says which attempt it holds, so the
        episode page reads that one file (the same rows the view shows for it).
        """
        with self._lock:
            if self._q is None:
                self.open()
            assert self._q is not None
            if self._turn_files is None:
                self._turn_files = {
                    (f.path.parent.name, f.path.name): f
                    for f in self._q.snapshot.files.get("turns", [])
                }
            info = self._turn_files.get((f"run_id={run_id}", f"{episode_id}.{write_id}.parquet"))
        return projected_source("turns", [info]) if info is not None else None

    def one(self, sql: str, params: Sequence[Any] | None = None) -> dict[str, Any] | None:
        res = self.fetch(sql, params, limit=1)
        return res.rows[0] if res.rows else None

    def views(self) -> dict[str, list[tuple[str, str]]]:
        with self._lock:
            if self._q is None:
                self.open()
            assert self._q is not None
            return self._q.views()


def _unique(names: list[str]) -> list[str]:
    """Column names made unique (`SELECT a.x, b.x` gives x and x_2), so rows can be dicts."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        k = seen.get(n, 0) + 1
        seen[n] = k
        out.append(n if k == 1 else f"{n}_{k}")
    return out
