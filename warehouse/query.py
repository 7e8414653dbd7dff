"""SQL over the warehouse: an in-memory DuckDB with views over the Parquet files.

DuckDB only *reads*: no database file exists, so nothing ever holds a lock that would
block a writer or another reader. `WarehouseQuery` lists each table's files (a consistent
snapshot, see layout.py), validates them (validate.py: bad ones are left out with a
warning naming them; badfiles.py: so are files any session found bad before), reads the
episode and run files at once (their names are rewritten in place; the turns shown are
chosen from exactly those rows), builds the raw views ``_raw_<table>`` (every attempt,
every batch), the current ``turns`` and ``partial_turns`` (turns still in journals), and
then creates every view of warehouse/views.py in order: the current state (``runs``,
``episodes``, ``scores`` ...), the common questions (``accuracy``, ``tool_calls`` ...)
and the statistics views of warehouse/series.py.

Read-only by default. Once the views exist, the connection is closed around the warehouse
with DuckDB's own settings: ``enable_external_access = false`` with the warehouse root as
the only ``allowed_directories`` entry (no other host file can be read: read_csv('/etc/
passwd'), read_text, glob, ATTACH, INSTALL/LOAD all fail), then ``lock_configuration =
true`` (no SET can undo it). Those settings let DuckDB *write* inside an allowed
directory (COPY ... TO, EXPORT DATABASE, ATTACH), so every statement is also classified
by DuckDB's own parser and only those that cannot name a file to write run (SELECT,
EXPLAIN of those, CREATE / INSERT / DROP ... in the session's in-memory catalog, CALL,
SET). ``host_files=True`` (`sandflow sql --allow-host-files`) opens a plain DuckDB
connection for the user's own exports and joins with other files.

A file whose header and footer are fine but whose data pages are corrupt passes the
snapshot's checks and fails inside a query with an error that may name no file. Such an
error makes the session read its files in full (validate.verify_data, cached per file) to
find the culprit; it is then left out like any other bad file (a warning names it,
``snapshot.bad`` lists it) and the query runs again without it. It is also written to the
warehouse's list of known-bad files (badfiles.py), so every later session, in any
process, leaves it out from the start and every count agrees.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pyarrow as pa

from datasets_prep.closing import ClosedOnExit
from tasks.pricing import PriceTable
from warehouse.badfiles import prime, remember
from warehouse.cost import run_prices
from warehouse.digest import DIGESTED_TABLES, plan_partition
from warehouse.duck import open_duckdb
from warehouse.journal import is_live, read_journal
from warehouse.layout import Layout
from warehouse.recovery import recovered_journals
from warehouse.schema import TABLES, schema_for
from warehouse.validate import (
    BadFile,
    FileInfo,
    FilesVanished,
    changed_since,
    known_bad,
    named_in,
    quarantine,
    validate_files,
    verify_files,
)
from warehouse.views import FULL_PROMPT_IDS, VIEWS
from warehouse.views import VIEW_HELP as VIEW_HELP  # callers read the listed views here too

log = logging.getLogger(__name__)
T = TypeVar("T")


class WarehouseError(RuntimeError):
    """A problem with the warehouse or a query, stated for the user."""


class WarehouseNotFound(WarehouseError):
    pass


class WarehouseQueryError(WarehouseError):
    pass


class RunNotFound(WarehouseError):
    """The warehouse holds no episodes of the run asked for (the message lists recent runs)."""


class ReadOnlyError(WarehouseQueryError):
    """A statement that could write a file, refused by the read-only SQL surface."""


# Statements that cannot name a file to write (the in-memory catalog is the session's own).
READ_ONLY_STATEMENTS = frozenset(
    {
        "SELECT", "EXPLAIN", "CREATE", "DROP", "ALTER", "INSERT", "UPDATE", "DELETE",
        "CALL", "SET", "VARIABLE_SET", "TRANSACTION",
    }
)  # fmt: skip

_REFUSED_HINT = (
    "sandflow's SQL is read-only over the warehouse: {what} is not run. Export a result with "
    "`sandflow sql QUERY --format csv|json|parquet --output FILE` (or Warehouse.query().arrow()"
    " in Python); for DuckDB with full access to your files (COPY ... TO, other files, "
    "ATTACH, extensions) pass --allow-host-files (host_files=True)."
)


def _statement_kinds(query: str) -> list[str]:
    """Each statement's type as DuckDB's own parser sees it (EXPLAIN: the explained one's)."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error:
        return []  # a syntax error: DuckDB reports it when the query runs
    kinds = []
    for st in statements:
        kind = st.type.name
        if kind == "EXPLAIN":
            kind = explained_kind(st.query)
        kinds.append(kind)
    return kinds


def explained_kind(text: str) -> str:
    """The type of the statement an EXPLAIN [ANALYZE] runs (EXPLAIN ANALYZE executes it).

    DuckDB's tokenizer marks keyword positions; the first suffix after the EXPLAIN keyword
    that DuckDB parses as one statement is the explained one.
    """
    keywords = [pos for pos, kind in duckdb.tokenize(text) if kind.name == "keyword"]
    for pos in keywords[1:]:
        try:
            inner = duckdb.extract_statements(text[pos:])
        except duckdb.Error:
            continue
        if len(inner) == 1:
            kind = inner[0].type.name
            return explained_kind(inner[0].query) if kind == "EXPLAIN" else kind
    return "EXPLAIN"  # nothing else parses: a plain EXPLAIN of what DuckDB will reject


def check_read_only(query: str) -> None:
    """Raise ReadOnlyError if a statement of `query` could write a file."""
    for kind in _statement_kinds(query):
        if kind not in READ_ONLY_STATEMENTS:
            what = {
                # DuckDB runs such a PIVOT as several statements, which may hide a COPY
                "MULTI": "a PIVOT without an IN list (name the values: PIVOT ... ON col IN ('a', 'b'))",
                "PRAGMA": "PRAGMA (use DESCRIBE <view> or CALL pragma_...() instead)",
            }.get(kind, f"a {kind.replace('_', ' ')} statement")
            raise ReadOnlyError(_REFUSED_HINT.format(what=what))


# DuckDB errors that are about the SQL or the session, never about a file's bytes.
_NOT_DATA_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(duckdb, name)
    for name in (
        "ParserException", "BinderException", "CatalogException", "SyntaxException",
        "PermissionException", "InterruptException", "OutOfMemoryException",
        "TransactionException", "ConstraintException", "DependencyException",
        "ConversionException", "OutOfRangeException", "NotImplementedException",
    )
    if hasattr(duckdb, name)
)  # fmt: skip


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _duck_type(t: pa.DataType) -> str:
    """DuckDB type of an Arrow type (for NULL columns an old file lacks)."""
    con = duckdb.connect()
    try:
        rel = con.from_arrow(pa.table({"x": pa.array([], t)}))
        return str(rel.types[0])
    finally:
        con.close()


_TYPE_CACHE: dict[str, str] = {}


def _null_col(table: str, name: str) -> str:
    key = f"{table}.{name}"
    if key not in _TYPE_CACHE:
        _TYPE_CACHE[key] = _duck_type(schema_for(table).field(name).type)
    return f'CAST(NULL AS {_TYPE_CACHE[key]}) AS "{name}"'


# Columns added after files existed, with a value derivable from older columns.
DERIVED: dict[tuple[str, str], tuple[str, str]] = {
    ("turns", "num_tool_calls"): ("tool_calls", "CAST(len(tool_calls) AS INTEGER)"),
}


def _project(table: str, name: str, have: set[str]) -> str:
    if name in have:
        return f'"{name}"'
    derived = DERIVED.get((table, name))
    if derived and derived[0] in have:
        return f'{derived[1]} AS "{name}"'
    return _null_col(table, name)


def projected_source(table: str, files: list[FileInfo], with_filename: bool = False) -> str:
    """SQL reading `files` as rows of `table`'s current schema (in that column order).

    Files sharing a column list form one plain read_parquet; groups are UNION ALL'ed.
    `with_filename` adds each row's file path as a last column, ``filename``.
    """
    names = schema_for(table).names
    groups: dict[tuple[str, ...], list[FileInfo]] = {}
    for f in files:
        groups.setdefault(f.columns, []).append(f)
    parts = []
    for columns, members in groups.items():
        have = set(columns)
        proj = ", ".join(_project(table, n, have) for n in names)
        paths = ", ".join(_sql_str(str(f.path)) for f in members)
        fn = (", filename", ", filename = true") if with_filename else ("", "")
        parts.append(
            f"SELECT {proj}{fn[0]} FROM read_parquet([{paths}], hive_partitioning = false{fn[1]})"
        )
    return " UNION ALL ".join(parts)


# Tables whose per-item files keep their name across rewrites (episodes/<episode_id>.parquet,
# runs/.../run.parquet): the views read them at snapshot time, not lazily at query time.
PINNED = ("runs", "episodes")


@dataclass
class Snapshot:
    """What the views were built from."""

    files: dict[str, list[FileInfo]] = field(default_factory=dict)
    bad: list[BadFile] = field(default_factory=list)
    quarantined: list[Path] = field(default_factory=list)
    journal_problems: list[str] = field(default_factory=list)


class WarehouseQuery(ClosedOnExit):
    """An in-memory DuckDB connection with the warehouse's views.

    ``run_id`` limits every view to one run (fewer files to open). ``quarantine`` moves
    bad files aside instead of only skipping them.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        run_id: str | None = None,
        quarantine: bool = False,
        threads: int | None = None,
        memory_limit: str | None = None,
        tables: tuple[str, ...] | None = None,
        host_files: bool = False,
        digests: bool = True,
        prices: PriceTable | None = None,
        known_bad: bool = True,
    ) -> None:
        self.layout = Layout(root)
        # prices the cost views use before each run's recorded table (warehouse/cost.py)
        self.prices = prices
        if not self.layout.root.is_dir():
            raise WarehouseNotFound(
                f"warehouse root {self.layout.root} does not exist. Point to one with "
                "--warehouse PATH, SANDFLOW_WAREHOUSE, or `warehouse = ...` in sandflow.toml "
                "(it is created by the first run that records episodes)."
            )
        self.run_id = run_id
        self.quarantine = quarantine
        self.host_files = host_files
        # Only these tables' files are read (others look empty): a cheap connection for
        # callers that need one table, e.g. done_keys on a large uncompacted run.
        self.tables = tuple(tables) if tables else TABLES
        # Uncompacted runs' small files are read through digests (warehouse.digest);
        # digests=False reads every file itself (`sandflow warehouse check` does).
        self.digests = digests
        # Leave out the files other sessions found bad (warehouse.badfiles); False: judge
        # every file afresh (`sandflow warehouse check`, which reads every page anyway).
        self.known_bad = known_bad
        self._digest_con: duckdb.DuckDBPyConnection | None = None
        self._digest_sources: dict[Path, list[str]] = {}  # digest -> names it must leave out
        self._read_files: list[Path] = []  # the files the last build read themselves
        self._arrow_tables: dict[str, pa.Table] = {}  # what the Arrow views read
        self._remove_unused_digests = digests and self.layout.readers_idle()
        self._readers_lock = self.layout.hold_readers_lock()
        self.con = open_duckdb(threads=threads)
        if memory_limit:
            self.con.execute(f"SET memory_limit = {_sql_str(memory_limit)}")
        with contextlib.suppress(duckdb.Error):  # older DuckDB: no such setting
            self.con.execute("SET parquet_metadata_cache = false")
        self.snapshot = Snapshot()
        try:
            self.refresh()
            if not host_files:
                self._close_around_warehouse()
        except BaseException:
            self.close()
            raise

    def _close_around_warehouse(self) -> None:
        """DuckDB may read the warehouse and nothing else, and cannot be told otherwise."""
        roots = {str(self.layout.root), str(self.layout.root.resolve())}
        allowed = ", ".join(_sql_str(r.rstrip("/") + "/") for r in sorted(roots))
        self.con.execute(f"SET allowed_directories = [{allowed}]")
        self.con.execute("SET enable_external_access = false")
        self.con.execute("SET lock_configuration = true")

    # ---- building --------------------------------------------------------------------
    def refresh(self) -> Snapshot:
        """Re-list and re-validate the files and recreate the views.

        Creating a view reads the files' schemas; if a concurrent compaction deleted a
        listed file meanwhile, or a re-record renamed a new one over it, list again (the
        new listing no longer names it / names the new version).
        """
        return reread_changed(
            self._build,
            attempts=5,
            renew=lambda: None,  # a build lists the files afresh
            # what this build read: digests first (one of them may be the bad one), then
            # the files read themselves, not the thousands a digest serves
            leave_out=lambda exc: self.leave_out_corrupt(
                exc, list(self._digest_sources) + self._read_files
            ),
            gave_up=f"{self.layout.root}: files kept changing while the views were built "
            "(a compaction or re-record loop?); try again",
        )

    def _build(self) -> Snapshot:
        snap = Snapshot()
        # Episodes are read (pinned) before the turns are listed, so every current attempt's
        # turns file exists by then (turns are written before their episode row), unless a
        # turns compaction switched meanwhile and dropped an attempt superseded since: then
        # build again.
        runs = [self.run_id] if self.run_id else self.layout.run_ids("turns")
        turns_switches = self.layout.manifest_stamps("turns", runs)
        self._digest_sources = {}
        self._read_files = []
        if self.known_bad:
            prime(self.layout.root)  # files other sessions found bad: left out here too
        for table in TABLES:
            files, digested = self._listed(table) if table in self.tables else ([], [])
            self._read_files += files
            good, bad = validate_files(files, table, strict=True)
            for info, leave_out in digested:
                self._digest_sources[info.path] = leave_out
            good += [info for info, _ in digested]
            snap.files[table] = good
            for b in bad:
                log.warning("warehouse: skipping %s", b)
                if self.quarantine:
                    snap.quarantined.append(quarantine(b, self.layout.root))
            snap.bad.extend(bad)
            self._create_raw_view(table, good)
            if table == "turns":
                switched = self.layout.manifest_stamps("turns", runs) != turns_switches
                if switched and "turns" in self.tables:
                    raise FilesVanished("turns were compacted while the snapshot was taken")
                self._create_current_turns(good)
        if "turns" in self.tables:
            self._create_partial_turns(snap)
        else:
            self._create_partial_turns(snap, journals=False)
        self._create_run_prices()
        self._create_abandoned_runs()
        for view in VIEWS:  # warehouse/views.py, in order
            if view.sql is not None:  # None: turns, partial_turns (built above)
                self.con.execute(f"CREATE OR REPLACE VIEW {view.name} AS {view.sql}")
        self.snapshot = snap
        self._remove_unused_digests = False  # other sessions may have opened since
        return snap

    def _listed(self, table: str) -> tuple[list[Path], list[tuple[FileInfo, list[str]]]]:
        """The table's visible files to read themselves, and the digests serving the rest
        (each with the names of the files it covers that it must leave out)."""
        if not self.digests or table not in DIGESTED_TABLES:
            return self.layout.table_files(table, self.run_id), []
        if self._digest_con is None:
            self._digest_con = open_duckdb()
        files: list[Path] = []
        digested: list[tuple[FileInfo, list[str]]] = []
        runs = [self.run_id] if self.run_id else self.layout.run_ids(table)
        for run in runs:
            part = self.layout.part_dir(table, run)
            listing = self.layout.partition_listing(table, run)
            plan = plan_partition(
                projected_source,
                self._digest_con,
                self.layout.root,
                table,
                run,
                part,
                listing,
                remove_unused=self._remove_unused_digests,
            )
            # A file known bad (warehouse.badfiles) is left out of the digests serving it
            # too, and listed to be read itself, so validation names it in snapshot.bad.
            read = set(plan.files)
            rotten = [
                n
                for n, (size, mtime_ns, ino) in listing
                if part / n not in read
                and known_bad((str(part / n), size, mtime_ns, ino)) is not None
            ]
            if rotten:
                plan.digests = [(info, sorted({*leave, *rotten})) for info, leave in plan.digests]
                plan.files += [part / n for n in rotten]
            files += plan.files
            digested += plan.digests
        return files, digested

    def _source(self, table: str, infos: list[FileInfo], with_filename: bool = False) -> str:
        """projected_source, with each digest limited to the files it still serves."""
        plain = [f for f in infos if f.path not in self._digest_sources]
        parts = [projected_source(table, plain, with_filename)] if plain else []
        for f in infos:
            if f.path in self._digest_sources:
                src = projected_source(table, [f], with_filename)
                leave_out = self._digest_sources[f.path]
                if leave_out:
                    src += f" WHERE _digest_file NOT IN ({', '.join(map(_sql_str, leave_out))})"
                parts.append(src)
        return " UNION ALL ".join(parts)

    def _pin(self, table: str, pinned: str, infos: list[FileInfo], good: list[FileInfo]) -> None:
        """Read `infos` (files rewritten in place) into the temp table `pinned`, each file
        one whole version.

        DuckDB opens a file by its path more than once per query (footer at bind, pages
        at scan), so a re-record renaming a new file over one in between is read half
        old, half new: an error ("TProtocolException: Invalid data") or mixed rows. Files
        whose version changed since validation are read again, alone (a window of a few
        milliseconds), until none changed; `good` gets their new versions.
        """
        src = self._source(table, infos, with_filename=True)
        try:
            self.con.execute(f"CREATE OR REPLACE TEMP TABLE {pinned} AS {src}")
            self.con.execute(f"ALTER TABLE {pinned} RENAME COLUMN filename TO _pinned_from")
            stale = set(changed_since(infos))
        except duckdb.Error as exc:
            if not changed_since(infos):
                raise
            log.debug("warehouse: %s rewritten while read (%s): read again", table, exc)
            self.con.execute(
                f"CREATE OR REPLACE TEMP TABLE {pinned} AS "
                f"SELECT *, NULL::VARCHAR AS _pinned_from FROM _empty_{table}"
            )
            digests = [i for i in infos if i.path in self._digest_sources]  # never rewritten
            if digests:
                self.con.execute(
                    f"INSERT INTO {pinned} {self._source(table, digests, with_filename=True)}"
                )
            stale = {i.path for i in infos if i.path not in self._digest_sources}
        for _ in range(50):
            if not stale:
                return
            self.con.execute(
                f"DELETE FROM {pinned} WHERE _pinned_from IN "
                f"({', '.join(_sql_str(str(p)) for p in stale)})"
            )
            fresh, bad = validate_files(sorted(stale), table, strict=True)
            if bad:  # now a bad file: a full rebuild reports it the usual way
                raise FilesVanished(f"{table}: {bad[0]}")
            good[:] = [g for g in good if g.path not in stale] + fresh
            try:
                self.con.execute(
                    f"INSERT INTO {pinned} {projected_source(table, fresh, with_filename=True)}"
                )
            except duckdb.Error:
                if not changed_since(fresh):
                    raise
                continue  # rewritten again mid-read: still stale
            stale = set(changed_since(fresh))
        raise FilesVanished(f"{table} kept being rewritten while read")

    def _create_raw_view(self, table: str, good: list[FileInfo]) -> None:
        """``_raw_<table>``: every good file, projected onto the current schema.

        Files are grouped by their column list (from the footer metadata); each group is
        one plain ``read_parquet`` (cheap to bind, unlike union_by_name, which opens every
        file's footer on every query), and columns a group lacks become typed NULLs.
        """
        empty_name = f"_empty_{table}"
        self._arrow_view(empty_name, _empty(table))
        parts = []
        reused = [f for f in good if not f.path.name.startswith("compacted-")]
        if table in PINNED and reused:
            # These names are rewritten in place (a re-record, finish_run): read them now,
            # so every later query sees this snapshot, the one the turns were chosen from.
            pinned = f"_pinned_{table}"
            self._pin(table, pinned, reused, good)
            parts.append(f"SELECT * EXCLUDE (_pinned_from) FROM {pinned}")
            # by name, not `f not in reused`: a list scan per file was quadratic (minutes
            # on 20,000 episode files)
            good = [f for f in good if f.path.name.startswith("compacted-")]
        if good:
            parts.append(self._source(table, good))  # unique names: never rewritten
        body = " UNION ALL ".join(parts) or f"SELECT * FROM {empty_name}"
        self.con.execute(f"CREATE OR REPLACE VIEW _raw_{table} AS {body}")

    def _create_run_prices(self) -> None:
        """``_run_prices``: each run x model's price, from the price table the run
        recorded or the one handed to this session (warehouse/cost.py)."""
        runs = self.con.execute(
            "SELECT run_id, config FROM _raw_runs "
            "QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY written_at DESC) = 1"
        ).fetchall()
        models = self.con.execute(
            "SELECT DISTINCT run_id, model FROM _raw_episodes WHERE model IS NOT NULL"
        ).fetchall()
        self._arrow_view("_run_prices", run_prices(runs, models, self.prices))

    def _create_abandoned_runs(self) -> None:
        """``_abandoned_runs``: runs recorded `running` whose run lock nobody holds (their
        process died without recording the end; warehouse/runlock.is_held). The ``runs``
        view shows them as interrupted: a reader never waits forever on a dead run."""
        from warehouse.runlock import abandoned

        running = self.con.execute(
            "SELECT run_id FROM _raw_runs "
            "QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY written_at DESC) = 1 "
            "AND status = 'running'"
        ).fetchall()
        gone = abandoned(self.layout, [r for (r,) in running])
        self._arrow_view("_abandoned_runs", pa.table({"run_id": pa.array(gone, pa.string())}))

    def _arrow_view(self, name: str, table: pa.Table) -> None:
        """A view of an Arrow table. Not `con.register`: that imports pandas (~0.5 s of
        every `sandflow sql`); the table is kept alive as long as the session."""
        self._arrow_tables[name] = table
        self.con.from_arrow(table).create_view(name, replace=True)

    def _create_current_turns(self, good: list[FileInfo]) -> None:
        """``turns``: only the turns of each episode's current attempt.

        Decided per file where possible, so queries pay nothing for it: a per-episode
        turns file names its attempt (``<episode>.<write_id>.parquet``) and is included
        only if that attempt is the episode's current one. A compacted file holds current
        attempts as of its compaction; only attempts since superseded (listed here, by
        write_id, usually none) are filtered out of it row by row.
        """
        current = {
            wid
            for (wid,) in self.con.execute(
                "SELECT write_id FROM _raw_episodes QUALIFY row_number() OVER ("
                "PARTITION BY run_id, episode_id ORDER BY written_at DESC, write_id DESC) = 1"
            ).fetchall()
        }
        per_episode: list[FileInfo] = []
        merged: list[FileInfo] = []
        for f in good:
            stem = f.path.name.removesuffix(".parquet")
            eid, dot, wid = stem.partition(".")
            if dot and not stem.startswith("compacted-") and "." not in wid:
                if wid in current:
                    per_episode.append(f)
            else:
                merged.append(f)
        parts = []
        if per_episode:
            parts.append(projected_source("turns", per_episode))
        if merged:  # compacted files and digests: may hold attempts superseded since
            src = self._source("turns", merged)
            present = {
                wid
                for (wid,) in self.con.execute(f"SELECT DISTINCT write_id FROM ({src})").fetchall()
            }
            stale = sorted(present - current)
            if stale:
                src = f"SELECT * FROM ({src}) WHERE write_id NOT IN ({', '.join(map(_sql_str, stale))})"
            parts.append(src)
        body = " UNION ALL ".join(parts) if parts else "SELECT * FROM _empty_turns"
        if any(f.prompt_deltas for f in per_episode + merged):
            body = FULL_PROMPT_IDS.format(body=body)
        self.con.execute(f"CREATE OR REPLACE VIEW turns AS {body}")

    def _create_partial_turns(self, snap: Snapshot, *, journals: bool = True) -> None:
        from warehouse.convert import turns_table

        parts: list[pa.Table] = []
        found: list[tuple[Path, str | None]] = []
        if journals:
            found = [(p, None) for p in self.layout.journal_files(self.run_id)]
            found += [(p, "recovered") for p in recovered_journals(self.layout, self.run_id)]
        for path, state in found:
            try:
                c = read_journal(path)
            except FileNotFoundError:
                continue
            snap.journal_problems.extend(c.problems)
            if c.episode is None or not c.turns:
                continue
            st = state or ("live" if is_live(path) else "orphaned")
            try:
                t = turns_table(c.turns, write_id=f"journal:{path.name}")
            except (OverflowError, ValueError, TypeError, pa.ArrowException) as exc:
                # one record that will not convert is named (and moved aside with
                # quarantine), never the end of every query on the warehouse
                self._journal_unreadable(snap, path, exc)
                continue
            n = t.num_rows
            t = t.append_column("journal_state", pa.array([st] * n, pa.string()))
            t = t.append_column("task_id", pa.array([c.episode.task_id] * n, pa.string()))
            t = t.append_column("domain", pa.array([c.episode.domain] * n, pa.string()))
            t = t.append_column("mode", pa.array([c.episode.mode] * n, pa.string()))
            t = t.append_column("journal", pa.array([str(path)] * n, pa.string()))
            parts.append(t)
        if parts:
            table = pa.concat_tables(parts)
        else:
            schema = schema_for("turns")
            for name in ("journal_state", "task_id", "domain", "mode", "journal"):
                schema = schema.append(pa.field(name, pa.string()))
            table = pa.Table.from_batches([], schema=schema)  # pa.array would import pandas
        self._arrow_view("_partial_turns_arrow", table)
        self.con.execute(
            "CREATE OR REPLACE VIEW partial_turns AS SELECT * FROM _partial_turns_arrow"
        )

    def _journal_unreadable(self, snap: Snapshot, path: Path, exc: BaseException) -> None:
        reason = (
            f"its turns do not convert to the turns table: {type(exc).__name__}: {str(exc)[:200]}"
        )
        log.warning("warehouse: journal %s left out: %s", path, reason)
        if self.quarantine and not is_live(path):
            moved = quarantine(BadFile(path, "journal", reason), self.layout.root)
            snap.quarantined.append(moved)
            snap.journal_problems.append(f"{path}: {reason}; moved to {moved}")
        else:
            hint = "" if self.quarantine else " (use --quarantine to move it aside)"
            snap.journal_problems.append(f"{path}: {reason}; left out{hint}")

    # ---- querying --------------------------------------------------------------------
    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """A lazy DuckDB relation (compose it, then .arrow() / .df() / .fetchall()).

        Errors in the SQL raise WarehouseQueryError here; prefer `rows` / `arrow` /
        `execute`, which also retry if a file vanished under a concurrent compaction or
        turned out to be corrupt (left out, with a warning).
        """
        self._admit(query)
        try:
            return self.con.sql(query)
        except duckdb.Error as exc:
            raise WarehouseQueryError(self._explain(query, exc)) from None

    def _admit(self, query: str) -> None:
        if not query or not query.strip():
            raise WarehouseQueryError("empty SQL query")
        if not self.host_files:
            check_read_only(query)

    def _retrying(self, query: str, run: Callable[[], T]) -> T:
        """Run `run`; if a file vanished under a concurrent compaction, or a file's data
        pages turn out to be corrupt (left out from now on), re-list and retry."""
        self._admit(query)
        return reread_changed(
            run,
            attempts=4,
            renew=self.refresh,
            leave_out=self.leave_out_corrupt,
            other=lambda exc: WarehouseQueryError(self._explain(query, exc)),
        )

    def leave_out_corrupt(self, exc: BaseException, files: list[Path] | None = None) -> bool:
        """After a DuckDB error that may come from a file's bytes: find the file(s) whose
        data pages do not decode among `files` (default: the snapshot's), so the next build
        leaves them out (validate's cache marks them bad). True if any was found."""
        if isinstance(exc, _NOT_DATA_ERRORS) or "configuration has been locked" in str(exc):
            return False
        if files is None:
            infos = {t: [f.path for f in fs] for t, fs in self.snapshot.files.items()}
        else:
            infos = {"": files}
        found: list[BadFile] = []
        for table, paths in infos.items():
            named = named_in(exc, paths)  # DuckDB names the file in some errors: read it first
            found += verify_files(named, table) or verify_files(paths, table)
        for b in found:
            log.warning("warehouse: leaving out %s (found while a query failed)", b)
        remember(self.layout.root, found)  # every later session leaves them out too
        return bool(found)

    def execute(self, query: str) -> duckdb.DuckDBPyConnection:
        """Run SQL now; fetch from the returned cursor (fetchall / fetchmany / description)."""
        return self._retrying(query, lambda: self.con.execute(query))

    def arrow(self, query: str) -> pa.Table:
        """The result as a pyarrow Table."""

        def run() -> pa.Table:
            rel = self.con.sql(query)
            return pa.table({}) if rel is None else rel.to_arrow_table()

        return self._retrying(query, run)

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        """The result as a list of tuples."""

        def run() -> list[tuple[Any, ...]]:
            cur = self.con.execute(query)
            return [] if cur.description is None else cur.fetchall()

        return self._retrying(query, run)

    def views(self) -> dict[str, list[tuple[str, str]]]:
        """View name -> [(column, type)] for the user-facing views."""
        out: dict[str, list[tuple[str, str]]] = {}
        for name in VIEW_HELP:
            rel = self.con.sql(f"SELECT * FROM {name} LIMIT 0")
            out[name] = [(c, str(t)) for c, t in zip(rel.columns, rel.types, strict=True)]
        return out

    def _explain(self, query: str, exc: BaseException) -> str:
        msg = first_line(exc)
        hint = ""
        m = re.search(r"Table with name (\w+) does not exist", str(exc))
        if m:
            hint = f"\nviews: {', '.join(VIEW_HELP)}"
        return f"SQL error ({type(exc).__name__}): {msg}{hint}\nquery: {query.strip()[:300]}"

    def close(self) -> None:
        self.con.close()
        if self._digest_con is not None:
            self._digest_con.close()
            self._digest_con = None
        if self._readers_lock is not None:
            os.close(self._readers_lock)  # releases the shared lock
            self._readers_lock = None


def _empty(table: str) -> pa.Table:
    """No rows of `table` (schema.empty_table would import pandas)."""
    return pa.Table.from_batches([], schema=schema_for(table))


def reread_changed(
    run: Callable[[], T],
    *,
    attempts: int,
    renew: Callable[[], object],
    leave_out: Callable[[duckdb.Error], bool],
    other: Callable[[duckdb.Error], BaseException] | None = None,
    gave_up: str = "the warehouse's files kept changing while they were read; try again",
) -> T:
    """`run()`, which reads the warehouse's files; when one changed while it was read,
    `renew()` (a new snapshot) and run again, `attempts` times at most. The one home of
    "a file changed while read: refresh and retry" (the views' build, queries, the viewer).

    A file changed while read: it vanished (a compaction merged it away, a re-record
    renamed a new version over it: FilesVanished, or DuckDB's "No such file"), or its
    data pages turn out not to decode (`leave_out(exc)` marks it bad, True, so the next
    listing leaves it out). Any other DuckDB error is raised at once: an IOException
    as WarehouseQueryError("reading the warehouse failed: ..."), the rest as `other(exc)`
    (default: the same sentence). Files still changing on the last attempt: `gave_up`.
    """
    for attempt in range(attempts):
        again = attempt < attempts - 1
        try:
            return run()
        except FilesVanished:
            if not again:
                break
            time.sleep(0.01 * attempt)  # let a burst of writes pass
        except duckdb.Error as exc:
            io = isinstance(exc, duckdb.IOException)
            if not (again and ((io and _vanished(exc)) or leave_out(exc))):
                if io or other is None:
                    raise WarehouseQueryError(
                        f"reading the warehouse failed: {first_line(exc)}"
                    ) from None
                raise other(exc) from None
        renew()
    raise WarehouseQueryError(gave_up)


def _vanished(exc: BaseException) -> bool:
    text = str(exc)
    return "No such file" in text or "No files found" in text or "does not exist" in text


def first_line(exc: BaseException) -> str:
    """An error's message in one line: its first three non-empty lines, 500 characters."""
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500] if lines else type(exc).__name__


def connect(root: Path | str, **kwargs: Any) -> WarehouseQuery:
    """Open a query connection on the warehouse at `root` (see WarehouseQuery)."""
    return WarehouseQuery(root, **kwargs)
