"""The report flow: report.html + report.md for a run, also as Prefect artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from analysis import metrics
from analysis.report import DEFAULT_VIEWER_URL, ReportData, to_markdown, write_report
from flows import artifacts
from warehouse import DEFAULT_ROOT, Warehouse


@flow(name="sandflow-report", log_prints=False)
def report_flow(
    run_id: str,
    warehouse: str = DEFAULT_ROOT,
    out_dir: str | None = None,
    verifier: str | None = None,
    alpha: float = 0.05,
    trend_runs: int = 14,
    viewer_url: str | None = DEFAULT_VIEWER_URL,
    max_cost_increase: float | None = None,
) -> dict[str, Any]:
    """report.html + report.md; with "Changes since the previous run" of the run's series
    (significant drops are returned as `regression`) and trends over `trend_runs` runs.
    The tables link to their episodes in `sandflow view` at `viewer_url` (None or "": no links).
    `max_cost_increase`: a rise of cost per task above this % since the previous run is a
    regression too (analysis.nightly_report.CostChange; None: cost is only reported)."""
    wh = Warehouse(warehouse)
    data = wh.load_run(run_id, verifier=verifier)
    run = wh.run_info(run_id) or {}
    meta = {
        "model": run.get("model") or (data.episodes[0].model if data.episodes else None),
        "task set": run.get("dataset"),
        "episodes": len(data.episodes),
        "status": run.get("status"),
    }
    rd = ReportData.from_run(data, {k: v for k, v in meta.items() if v is not None})
    rd.viewer_url = viewer_url or None
    rd.cost = _cost(wh, run_id)
    rd.nightly = _nightly_section(warehouse, run_id, alpha, trend_runs, max_cost_increase)
    rd.nightly.viewer_url = rd.viewer_url
    out = Path(out_dir or Path(warehouse) / "reports" / run_id).expanduser()
    html_path, md_path = write_report(rd, out)
    key = artifacts.artifact_key("report", run_id)
    artifacts.markdown(to_markdown(rd) + f"\n\nFull page: `{html_path.resolve()}`\n", key, f"sandflow report of {run_id}")
    for name, title, rows in rd.tables():
        artifacts.table(rows, artifacts.artifact_key(name, run_id), title)
    artifacts.table(rd.nightly.table_rows(), artifacts.artifact_key("changes", run_id), "Changes since the previous run")
    return {
        "run_id": run_id,
        "html": str(html_path.resolve()),
        "markdown": str(md_path.resolve()),
        "previous_run_id": rd.nightly.previous_run_id,
        "changes": rd.nightly.table_rows(),
        "cost_changes": [c.row() for c in rd.nightly.cost],
        "regression": rd.nightly.regression_message(),
        # what `sandflow bench` prints: the report's own numbers, not a second reading
        "accuracy": rd.accuracy,
        "usage": [r for r in rd.usage if r["domain"] == metrics.ALL],
        "token_ratio": rd.ratio.get(metrics.ALL),
    }


def _cost(wh: Warehouse, run_id: str) -> list[dict[str, Any]]:
    """The run's cost per mode, priced by the table the run recorded (warehouse/cost.py)."""
    from warehouse.cost import cost_by_mode

    with wh.query(run_id=run_id, tables=("runs", "episodes", "turns")) as q:
        return cost_by_mode(q, run_id)


def _nightly_section(
    warehouse: str, run_id: str, alpha: float, trend_runs: int, max_cost_increase: float | None = None
) -> Any:
    """The run's series read from the warehouse, compared and plotted (analysis/nightly_report)."""
    from analysis.nightly_report import build_section

    wh = Warehouse(warehouse)
    section = build_section(
        wh.series(run_id, last=trend_runs), alpha=alpha, max_cost_increase=max_cost_increase
    )
    section.trajectories = wh.trajectories(section.episodes_to_link())
    return section
