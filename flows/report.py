"""The report flow: report.html + report.md for a run, also as Prefect artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from analysis.report import ReportData, to_markdown, write_report
from flows import artifacts
from warehouse import DEFAULT_ROOT, Warehouse


@flow(name="sandflow-report", log_prints=False)
def report_flow(
    run_id: str,
    warehouse: str = DEFAULT_ROOT,
    out_dir: str | None = None,
    verifier: str | None = None,
) -> dict[str, Any]:
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
    out = Path(out_dir or Path(warehouse) / "reports" / run_id).expanduser()
    html_path, md_path = write_report(rd, out)
    key = artifacts.artifact_key("report", run_id)
    artifacts.markdown(to_markdown(rd) + f"\n\nFull page: `{html_path.resolve()}`\n", key, f"sandflow report of {run_id}")
    for name, title, rows in rd.tables():
        artifacts.table(rows, artifacts.artifact_key(name, run_id), title)
    return {"run_id": run_id, "html": str(html_path.resolve()), "markdown": str(md_path.resolve())}
