"""`sandflow compare`: a paired comparison of two runs (or of one run's two modes).

The same statistics as the report's "Changes since the previous run"
(analysis/comparisons.py; docs/statistics.md), for any two runs on one task set: model A
against model B, a config change, a rerun. Tasks are matched by (mode, task id), and only
when both runs ran the same task under that id: the tasks each run recorded are compared by
content (warehouse.tasksets), or, for runs recorded before runs kept their tasks, the
task-set hashes must agree; anything else is refused with the reason.
"""

from __future__ import annotations

import json
from typing import Any

import typer

EXIT_REGRESSION = 3  # --fail-on-regression found a significant drop (as `sandflow bench`)


def compare(
    run_a: str = typer.Argument(..., help="The baseline run (A)."),
    run_b: str = typer.Argument(
        None, help="The run compared with it (B). Omitted: sandbox vs LLM mode of RUN_A."
    ),
    warehouse: str = typer.Option(
        None,
        "--warehouse",
        "-w",
        help="Warehouse root (default: SANDFLOW_WAREHOUSE or ./warehouse_data).",
    ),
    alpha: float = typer.Option(
        0.05, "--alpha", min=0.0001, max=0.5, help="Significance level (Holm-adjusted)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    fail_on_regression: bool = typer.Option(
        False,
        "--fail-on-regression",
        help=f"Exit {EXIT_REGRESSION} when B dropped significantly below A.",
    ),
) -> None:
    """Paired comparison, task by task: B - A per domain x mode with its 95% CI, the tasks
    that flipped, an exact test (McNemar / sign), Holm-adjusted across the rows.

    [bold]Examples[/]
      sandflow compare nightly-20260301-020000-ab12 nightly-20260302-020000-cd34
      sandflow compare RUN                  # sandbox vs LLM mode of one run
      sandflow compare A B --json
    """
    from analysis.comparisons import (
        compare_modes,
        compare_runs,
        describe_change,
        outcomes_from_rows,
    )
    from sandflow.config import load_settings
    from sandflow.console import console as stdout_console
    from warehouse import Warehouse
    from warehouse.query import WarehouseError
    from warehouse.series import read_outcomes

    console = stdout_console()

    def fail(msg: str) -> None:
        console.print(f"[bold red]error:[/] {msg}", highlight=False)
        raise typer.Exit(1)

    root = str(load_settings(**({"warehouse": warehouse} if warehouse else {})).warehouse)
    wanted = [run_a] if run_b is None else [run_a, run_b]
    try:
        _, rows = read_outcomes(root, wanted)
    except (WarehouseError, ValueError) as exc:
        fail(str(exc))
    have = {r["run_id"] for r in rows}
    for run in wanted:
        if run not in have:
            fail(f"run {run!r} has no episodes in warehouse {root}")
    outcomes = outcomes_from_rows(rows)
    if run_b is None:
        result = compare_modes(outcomes, alpha=alpha)
        if not result:
            fail(f"run {run_a!r} did not run both modes on any task: nothing to pair")
        title = f"sandbox vs LLM mode of {run_a}"
    else:
        # Tasks are paired by id only when both runs ran the same task under it: by the
        # tasks each run recorded (content), else by their task-set hashes; a run that
        # records neither is refused (warehouse.tasksets.unlike_tasks).
        why = Warehouse(root).unlike_tasks(run_a, run_b)
        if why:
            fail(why)
        result = compare_runs(
            [o for o in outcomes if o.run_id == run_a],
            [o for o in outcomes if o.run_id == run_b],
            alpha=alpha,
        )
        title = f"{run_b} against {run_a}"
    table = [r.row() for r in result]
    if as_json:
        console.print_json(json.dumps({"title": title, "rows": table}, default=str))
    else:
        _print(console, table, f"{title} (points; 95% CI; Holm-adjusted over {len(table)} rows)")
        for r in result:
            if r.significant:
                console.print(
                    f"[bold]{'▼' if r.direction == 'down' else '▲'}[/] {describe_change(r)}",
                    highlight=False,
                )
        if not any(r.significant for r in result):
            console.print("no significant difference (every difference within noise)")
    if fail_on_regression and any(r.is_regression for r in result):
        raise typer.Exit(EXIT_REGRESSION)


def _print(console: Any, rows: list[dict[str, Any]], title: str) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    if not rows:
        t.add_column("(no rows)")
    else:
        for c in rows[0]:
            t.add_column(str(c), justify="left" if c in ("domain", "mode", "test") else "right")
        for r in rows:
            t.add_row(*["—" if r[c] is None else str(r[c]) for c in rows[0]])
    console.print(t)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
