"""Opening DuckDB on the warehouse's files.

Episode and run files are rewritten in place (a re-record renames a new file over the
old name). DuckDB's external file cache (on by default since 1.3) keeps file blocks
keyed by path and checks them against the file's modification time, which a rewrite in
the same second does not change: a session then read the new file through the old
file's cached blocks and failed with "TProtocolException: Invalid data" (and a long-lived
verifier connection could call a good file corrupt). Every connection that reads
warehouse files is opened here, with that cache off; the OS page cache still serves
repeated reads.
"""

from __future__ import annotations

import contextlib

import duckdb


def open_duckdb(*, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB for reading warehouse files (see module doc)."""
    con = duckdb.connect(":memory:")
    with contextlib.suppress(duckdb.Error):  # DuckDB before 1.3: no such cache
        con.execute("SET enable_external_file_cache = false")
    con.execute("SET enable_progress_bar = false")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    return con
