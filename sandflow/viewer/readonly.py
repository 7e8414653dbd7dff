"""Make a warehouse query connection safe to hand to whoever can reach the viewer.

The viewer's SQL box runs SQL typed into a web page on the connection that serves every
page, so the connection must not read or write anything outside the warehouse and
must not be reconfigured. Two locks, because either alone leaves a hole:

- DuckDB's own: external access off except the warehouse's table folders (the views
  read their Parquet files lazily, so those stay readable), then the configuration
  locked, so no statement can turn access back on. This stops `read_text('/etc/...')`,
  `COPY ... TO '/tmp/x'`, `INSTALL`/`LOAD` of extensions and reads of any other file.
- A statement allowlist: one SELECT (or EXPLAIN of one). DuckDB still lets a connection
  write *inside* an allowed folder (`COPY ... TO '<warehouse>/turns/...'` would plant a
  forged file in the warehouse, `ATTACH` would create one), and DDL would drop the very
  views the pages read. Only a query passes.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from warehouse.query import WarehouseQuery, WarehouseQueryError
from warehouse.schema import TABLES

ALLOWED_STATEMENTS = frozenset({duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN})


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def lock_down(q: WarehouseQuery) -> None:
    """Restrict `q`'s connection to reading the warehouse's table folders, for good.

    Call it after the views are built (building registers and reads files); the lock
    cannot be undone on this connection, so a refresh builds a new WarehouseQuery.
    """
    con = q.con
    ((locked, external),) = con.execute(
        "SELECT current_setting('lock_configuration'), current_setting('enable_external_access')"
    ).fetchall()
    if str(locked).lower() == "true":
        if str(external).lower() != "false":
            raise WarehouseQueryError(
                "the query connection's configuration is locked with external access on: "
                "the viewer cannot make it read-only"
            )
        return  # the query layer already closed it around the warehouse
    root = Path(q.layout.root).absolute()
    dirs = [str(root / t) + "/" for t in TABLES]
    con.execute(f"SET allowed_directories = [{', '.join(_sql_str(d) for d in dirs)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def check_read_only(sql: str) -> str:
    """`sql` if it is one SELECT / EXPLAIN statement, else a WarehouseQueryError saying why."""
    text = sql.strip().rstrip(";").strip()
    if not text:
        raise WarehouseQueryError("empty SQL query")
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WarehouseQueryError(f"SQL error: {first}") from None
    if len(statements) != 1:
        raise WarehouseQueryError(
            f"one statement at a time, please (got {len(statements)}): the SQL box runs a "
            "single SELECT"
        )
    kind = statements[0].type
    if kind == duckdb.StatementType.EXPLAIN and _explained(statements[0].query) != "SELECT":
        # EXPLAIN ANALYZE runs what it explains: `EXPLAIN ANALYZE COPY ... TO
        # '<warehouse>/turns/...'` would plant a file in the warehouse
        raise WarehouseQueryError(
            "the viewer is read-only: only a SELECT may be explained (EXPLAIN ANALYZE runs "
            "the statement it explains)"
        )
    if kind not in ALLOWED_STATEMENTS:
        name = getattr(kind, "name", str(kind))
        raise WarehouseQueryError(
            f"the viewer is read-only: {name} statements are not allowed, only SELECT "
            "(and EXPLAIN). Export with `sandflow sql ... --format parquet --output FILE`."
        )
    return text


_EXPLAIN = re.compile(r"^\s*explain(\s+analy[sz]e)?\b", re.IGNORECASE)


def _explained(query: str, depth: int = 0) -> str:
    """The type of the statement an EXPLAIN [ANALYZE] explains (EXPLAIN ANALYZE runs it)."""
    inner = _EXPLAIN.sub("", query, count=1).strip().rstrip(";")
    try:
        found = duckdb.extract_statements(inner)
    except duckdb.Error:
        return "?"
    if len(found) != 1 or depth > 3:
        return "?"
    st = found[0]
    if st.type == duckdb.StatementType.EXPLAIN:
        return _explained(st.query, depth + 1)
    return str(getattr(st.type, "name", st.type))
