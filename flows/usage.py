"""The usage flow: label every turn's capabilities and store the labels and the rates.

Rules: analysis/usage_rules.py (one table). Labels go to the warehouse's usage table
(one row per tool call and capability, so SQL can slice them any way); the flow
returns the paper's rates: share of sandbox-mode turns using each capability, per
domain and overall.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from analysis import metrics
from flows import artifacts
from warehouse import DEFAULT_ROOT, Warehouse

LABELER = "rules-v1"


@flow(name="sandflow-usage", log_prints=False)
def usage_flow(run_id: str, warehouse: str = DEFAULT_ROOT, store_labels: bool = True) -> dict[str, Any]:
    wh = Warehouse(warehouse)
    data = wh.load_run(run_id)
    path = None
    if store_labels:
        rows = [dict(r, run_id=run_id, labeler=LABELER) for r in metrics.usage_call_rows(data)]
        path = wh.write_usage(rows)
    rates = metrics.usage_rates(metrics.turn_labels(data))
    artifacts.table(rates, artifacts.artifact_key("usage", run_id), f"Capability usage of run {run_id} (% of turns)")
    return {"run_id": run_id, "rates": rates, "labels_file": str(path) if path else None}
