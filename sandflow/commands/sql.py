"""`sandflow sql` and `sandflow warehouse ...`: the commands of the warehouse/ library.

Heavy imports (duckdb, pyarrow) happen inside the command bodies so `sandflow --help`
stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from sandflow.console import cell_width
from sandflow.console import console as stdout_console
from sandflow.errors import EXIT_FAILED, EXIT_USAGE, err_console, fail

if TYPE_CHECKING:
    from rich.console import Console

    from tasks.pricing import PriceTable
    from warehouse.query import WarehouseQuery

FORMATS = ("table", "csv", "json", "parquet")

SQL_HELP = """Query the warehouse with SQL (DuckDB dialect) over its Parquet files.

[bold]Examples[/bold]

  sandflow sql                                  # list the views and their columns
  sandflow sql "SELECT * FROM accuracy"
  sandflow sql "SELECT domain, mode, avg(total_tokens) FROM episode_tokens GROUP BY ALL"
  sandflow sql "SELECT * FROM timeouts LIMIT 10" --run my-run
  sandflow sql "SELECT * FROM turns" --format parquet --output turns.parquet

[bold]Views[/bold]: runs, episodes, turns, scores, usage, partial_turns, tool_calls,
accuracy, accuracy_by_verifier, episode_tokens, capability_usage, slow_tools, timeouts, errors,
turn_cost, episode_cost, run_cost (dollars: --prices or the run's recorded price table).
Raw files (every attempt and batch): _raw_<table>.

Bad files (truncated, corrupt, foreign schema) are left out with a warning naming them;
--quarantine moves them to <warehouse>/_quarantine/.

[bold]Read-only[/bold]: the SQL reads the warehouse and nothing else. COPY ... TO, EXPORT,
ATTACH, INSTALL/LOAD, SET and reading other host files (read_csv('/etc/passwd'),
read_text, glob) are refused. Save a result with --format csv|json|parquet --output FILE;
--allow-host-files gives the SQL DuckDB's full access to your files (your own exports,
joins with other files).
"""


def _resolve_root(warehouse: Path | None) -> Path:
    """The flag, else Settings.warehouse (SANDFLOW_WAREHOUSE, sandflow.toml, ./warehouse_data)."""
    if warehouse is not None:
        return warehouse
    from sandflow.config import settings_warehouse

    return settings_warehouse()


def _err_console() -> Console:
    return err_console()


def _session_prices(flag: str | None) -> PriceTable | None:
    """The price table the cost views use before each run's own: --prices, else the
    settings' (SANDFLOW_PRICES, sandflow.toml); a bad one is exit 2 naming what is wrong."""
    from pydantic import ValidationError

    from sandflow.config import flag_prices, load_settings

    if flag is not None:
        try:
            return flag_prices(flag)
        except ValueError as exc:
            raise fail(str(exc), EXIT_USAGE) from None

    try:
        return load_settings().prices or None
    except (ValidationError, ValueError, OSError):
        return None  # a broken config file must not stop a query (settings_warehouse)


def _open(
    root: Path,
    run: str | None,
    quarantine: bool,
    host_files: bool = False,
    digests: bool = True,
    prices: PriceTable | None = None,
    known_bad: bool = True,
) -> WarehouseQuery:
    from warehouse.query import WarehouseError, WarehouseQuery

    err = _err_console()
    try:
        q = WarehouseQuery(
            root,
            run_id=run,
            quarantine=quarantine,
            host_files=host_files,
            digests=digests,
            prices=prices,
            known_bad=known_bad,
        )
    except (WarehouseError, ValueError) as exc:
        raise fail(str(exc), EXIT_FAILED) from None
    _warn_bad(q, quarantine, already=set())
    for p in q.snapshot.journal_problems[:5]:
        err.print(f"[yellow]journal:[/yellow] {escape(p)}", soft_wrap=True)  # paths whole
    return q


def _warn_bad(q: WarehouseQuery, quarantine: bool, already: set[Path]) -> None:
    """Name the bad files left out that were not named before (a query can find more:
    a file whose data pages are corrupt shows only when it is read)."""
    new = [b for b in q.snapshot.bad if b.path not in already]
    if not new:
        return
    err = _err_console()
    verb = "moved to _quarantine" if quarantine else "skipped (use --quarantine to move them aside)"
    err.print(f"[yellow]warning:[/yellow] {len(new)} bad file(s) {verb}:")
    for b in new[:20]:
        err.print(f"  [yellow]{b.path}[/yellow]: {b.reason}")
    if len(new) > 20:
        err.print(f"  ... and {len(new) - 20} more")


def _cell(v: Any, width: int | None) -> str:
    if v is None:
        return "[dim]NULL[/dim]"
    if isinstance(v, float):
        s = f"{v:.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    elif isinstance(v, dict | list):
        s = json.dumps(v, default=str, ensure_ascii=False)
    else:
        s = str(v)
    s = s.replace("\n", "⏎")
    from rich.markup import escape

    return escape(s if width is None or len(s) <= width else s[: width - 1] + "…")


def print_views(q: WarehouseQuery, console: Console) -> None:
    from rich.table import Table

    from warehouse.query import VIEW_HELP

    table = Table(title=f"Views of {q.layout.root}", show_lines=False, expand=False)
    table.add_column("view", style="bold cyan", no_wrap=True)
    table.add_column("what", style="dim")
    table.add_column("columns")
    for name, cols in q.views().items():
        table.add_row(
            name, VIEW_HELP.get(name, ""), ", ".join(f"{c} [dim]{t}[/dim]" for c, t in cols)
        )
    console.print(table)
    files = {t: len(v) for t, v in q.snapshot.files.items()}
    console.print(
        "files: " + ", ".join(f"{t} {n}" for t, n in files.items()),
        style="dim",
    )


def _print_result(
    q: WarehouseQuery, query: str, limit: int, width: int | None, console: Console
) -> int:
    from rich.table import Table

    cur = q.execute(query)
    if cur.description is None:  # a statement without a result (SET, CREATE VIEW ...)
        console.print("[dim]ok[/dim]")
        return 0
    columns = [d[0] for d in cur.description]
    numeric = [str(d[1]).upper().split("(")[0] in _NUMERIC for d in cur.description]
    try:
        rows = cur.fetchmany(limit + 1)
    except Exception as exc:  # duckdb errors may surface at fetch time
        from warehouse.query import WarehouseQueryError

        raise WarehouseQueryError(q._explain(query, exc)) from None
    more = len(rows) > limit
    rows = rows[:limit]
    table = Table(show_lines=False, header_style="bold")
    for col, num in zip(columns, numeric, strict=True):
        table.add_column(col, justify="right" if num else "left", overflow="fold")
    for r in rows:
        table.add_row(*(_cell(v, width) for v in r))
    console.print(table)
    note = f"{len(rows)} row{'s' if len(rows) != 1 else ''}"
    if more:
        note = f"first {limit} rows shown (more exist: --limit N, or --format csv --output FILE)"
    console.print(note, style="dim")
    return len(rows)


_NUMERIC = {
    "NUMBER", "TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT",
    "UINTEGER", "UBIGINT", "FLOAT", "DOUBLE", "DECIMAL",
}  # fmt: skip


def export(q: WarehouseQuery, query: str, fmt: str, output: Path | None) -> int:
    """Write the result as csv/json/parquet to `output` (csv/json may go to stdout)."""
    import pyarrow as pa

    table: pa.Table = q.arrow(query)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        assert output is not None
        pq.write_table(table, output, compression="zstd")
    elif fmt == "csv":
        import pyarrow.csv as pacsv

        flat = _flatten_for_text(table)
        if output is None:
            sink = pa.BufferOutputStream()
            pacsv.write_csv(flat, sink)
            sys.stdout.write(sink.getvalue().to_pybytes().decode())
        else:
            pacsv.write_csv(flat, output)
    else:  # json: an array of objects
        text = json.dumps(table.to_pylist(), default=str, ensure_ascii=False, indent=1)
        if output is None:
            sys.stdout.write(text + "\n")
        else:
            output.write_text(text + "\n", encoding="utf-8")
    return int(table.num_rows)


def _flatten_for_text(table: Any) -> Any:
    """CSV cannot hold lists/structs: such columns become JSON text."""
    import pyarrow as pa

    cols = []
    for name in table.column_names:
        col = table[name]
        if pa.types.is_nested(col.type):
            col = pa.array(
                [None if v is None else json.dumps(v, default=str) for v in col.to_pylist()],
                pa.string(),
            )
        cols.append(col)
    return pa.table(cols, names=table.column_names)


def _interactive(q: WarehouseQuery, console: Console, limit: int, width: int | None) -> None:
    from warehouse.query import WarehouseQueryError

    console.print("[dim]Enter SQL ending with ';'. Commands: .views  .quit[/dim]")
    buf: list[str] = []
    while True:
        try:
            line = input("sql> " if not buf else "...> ")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        stripped = line.strip()
        if not buf and stripped in (".quit", ".exit", "quit", "exit"):
            return
        if not buf and stripped == ".views":
            print_views(q, console)
            continue
        buf.append(line)
        if not stripped.endswith(";"):
            continue
        query = "\n".join(buf).rstrip().rstrip(";")
        buf = []
        seen = {b.path for b in q.snapshot.bad}
        try:
            _print_result(q, query, limit, width, console)
        except WarehouseQueryError as exc:
            console.print(f"[red]{exc}[/red]")
        _warn_bad(q, q.quarantine, seen)


def sql(
    query: str | None = typer.Argument(
        None, help="SQL to run. Omit it to list the views (and get a prompt on a terminal)."
    ),
    warehouse: Path | None = typer.Option(
        None,
        "--warehouse",
        "-w",
        help="Warehouse root. Default: SANDFLOW_WAREHOUSE, sandflow.toml, ./warehouse_data.",
    ),
    run: str | None = typer.Option(None, "--run", "-r", help="Only this run's files (faster)."),
    fmt: str = typer.Option(
        "table", "--format", "-f", help="table (terminal), csv, json or parquet."
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Write the result here (required for parquet)."
    ),
    limit: int = typer.Option(50, "--limit", "-n", min=1, help="Rows shown in table format."),
    max_width: int | None = typer.Option(
        None,
        "--max-width",
        min=8,
        help="Cut cells longer than this. Default: 60 on a terminal; not cut when the "
        "output is not a terminal (a pipe or file gets every id and path whole).",
    ),
    quarantine: bool = typer.Option(
        False, "--quarantine", help="Move bad files to <warehouse>/_quarantine/."
    ),
    allow_host_files: bool = typer.Option(
        False,
        "--allow-host-files",
        help="Give the SQL DuckDB's full access to your files: COPY ... TO, reading "
        "other files, ATTACH, extensions. Off by default: the SQL only reads the warehouse.",
    ),
    prices: str | None = typer.Option(
        None,
        "--prices",
        help="Price table (JSON file or text) the cost views use before each run's "
        "recorded one, e.g. to price a run recorded without one. docs/cost.md.",
    ),
) -> None:
    from warehouse.query import WarehouseQueryError

    err = _err_console()
    if fmt not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}", EXIT_USAGE)
    if fmt == "parquet" and output is None:
        raise fail("--format parquet needs --output FILE", EXIT_USAGE)
    if fmt == "table" and output is not None:
        raise fail("--output needs --format csv, json or parquet", EXIT_USAGE)
    root = _resolve_root(warehouse)
    console = stdout_console()
    width = cell_width(console, max_width, 60)
    session_prices = _session_prices(prices)
    with _open(root, run, quarantine, allow_host_files, prices=session_prices) as q:
        seen = {b.path for b in q.snapshot.bad}
        try:
            if query is None:
                print_views(q, console)
                if sys.stdin.isatty():
                    _interactive(q, console, limit, width)
                return
            if fmt == "table":
                _print_result(q, query, limit, width, console)
            else:
                n = export(q, query, fmt, output)
                if output is not None:
                    err.print(f"wrote {n} rows to {output} ({fmt})")
        except WarehouseQueryError as exc:
            _warn_bad(q, quarantine, seen)
            raise fail(str(exc), EXIT_FAILED) from None
        _warn_bad(q, quarantine, seen)

wh_app = typer.Typer(
    name="warehouse",
    help="Maintain the warehouse: compact runs, find and recover interrupted episodes, check files.",
    no_args_is_help=True,
)

ROOT_OPT = typer.Option(
    None, "--warehouse", "-w", help="Warehouse root (default as for `sql`)."
)

@wh_app.command("compact")
def compact(
    run: str = typer.Argument(..., help="Run id to compact."),
    warehouse: Path | None = ROOT_OPT,
) -> None:
    """Merge a run's per-episode files into one file per table (safe while writing)."""
    from warehouse.store import Warehouse

    wh = Warehouse(_resolve_root(warehouse))
    try:
        with err_console().status(f"compacting {run} ..."):
            res = wh.compact(run)
    except ValueError as exc:
        raise fail(str(exc), EXIT_FAILED) from None
    console = stdout_console()
    if not res.changed:
        console.print(f"{run}: nothing to compact")
    for t, n in res.files_before.items():
        console.print(f"{t}: {n} file(s) -> 1 ({res.rows_after.get(t, 0)} rows)")
    for b in res.skipped_bad:
        _err_console().print(f"[yellow]skipped bad file[/yellow] {b}")

@wh_app.command("orphans")
def orphans(
    run: str | None = typer.Argument(None, help="Run id (default: all runs)."),
    warehouse: Path | None = ROOT_OPT,
    recover: bool = typer.Option(
        False,
        "--recover",
        help="Commit them as termination='interrupted' (resume re-runs them).",
    ),
    discard: bool = typer.Option(False, "--discard", help="Delete their journals."),
) -> None:
    """List episodes whose writer died mid-way (journals nobody holds); recover or discard."""
    from rich.table import Table

    from warehouse.store import Warehouse

    if recover and discard:
        raise fail("choose one of --recover / --discard", EXIT_USAGE)
    wh = Warehouse(_resolve_root(warehouse))
    found = wh.orphans(run)
    console = stdout_console()
    table = Table(title=f"{len(found)} orphaned episode(s)")
    for c in ("run", "episode", "task", "mode", "sample", "turns", "problems"):
        table.add_column(c)
    for o in found:
        table.add_row(
            o.run_id, o.episode_id, str(o.task_id), str(o.mode), str(o.sample_index),
            str(o.turns), "; ".join(o.problems)[:80],
        )  # fmt: skip
    console.print(table)
    if recover or discard:
        done = wh.recover(run, action="recover" if recover else "discard")
        console.print(f"{'recovered' if recover else 'discarded'} {len(done)} episode(s)")

@wh_app.command("check")
def check(
    warehouse: Path | None = ROOT_OPT,
    run: str | None = typer.Option(None, "--run", "-r"),
    quarantine: bool = typer.Option(False, "--quarantine", help="Move bad files aside."),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="Check headers and footers only (fast); by default every data page of "
        "every file is read and its checksum verified.",
    ),
) -> None:
    """Validate every file: magic bytes, footer, schema, and (unless --quick) every data
    page of every column. Lists bad files by name; exit code 1 if there are any."""
    from warehouse.badfiles import settle
    from warehouse.validate import quarantine as move_aside
    from warehouse.validate import verify_files

    root = _resolve_root(warehouse)
    err = _err_console()
    # the files themselves, not digests; every page read: files once found bad are
    # judged again (a passing I/O fault is forgotten), except with --quick
    with _open(root, run, quarantine, digests=False, known_bad=quick) as q:
        good = {t: [f.path for f in fs] for t, fs in q.snapshot.files.items()}
        n = sum(len(v) for v in good.values())
        corrupt = []
        if not quick and n:
            with err_console().status(f"reading every page of {n} file(s) ..."):
                for table, paths in good.items():
                    corrupt += verify_files(paths, table)
            settle(q.layout.root, [p for ps in good.values() for p in ps], corrupt)
        for b in corrupt:
            err.print(f"  [yellow]{b.path}[/yellow]: {b.reason}")
            if quarantine:
                dest = move_aside(b, q.layout.root)
                err.print(f"    moved to {dest}")
        bad = len(q.snapshot.bad) + len(corrupt)
        depth = "headers and footers" if quick else "every page read"
        stdout_console().print(f"{n - len(corrupt)} good file(s), {bad} bad ({depth})")
        if bad:
            raise typer.Exit(EXIT_FAILED)


def register(app: typer.Typer) -> None:
    """Add this room's commands to the main app: `sql` and the `warehouse` group."""
    app.command("sql", help=SQL_HELP, rich_help_panel="Results")(sql)
    app.add_typer(wh_app, rich_help_panel="Results")
