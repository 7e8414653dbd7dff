"""The runs table: one row per run (what was run, with what, when).

`write_run` at the start, `finish_run` at the end; both replace
``runs/run_id=R/run.parquet`` atomically. The config is scrubbed of anything secret
(see secrets.py) before it is stored.
"""

from __future__ import annotations

import getpass
import socket
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import pyarrow.parquet as pq

from datasets_prep.secrets import scrub
from warehouse.convert import dumps, now_utc, rows_table, utc
from warehouse.layout import Layout, write_parquet_atomic
from warehouse.schema import check_run_id

# budget_exhausted: the run's --max-cost / --max-run-tokens stopped it (engine.budget)
RUN_STATUSES = ("running", "finished", "failed", "interrupted", "budget_exhausted")


def _sandflow_version() -> str | None:
    try:
        return version("sandflow")
    except PackageNotFoundError:
        return None


def write_run(
    layout: Layout,
    run_id: str,
    *,
    model: str | None = None,
    image: str | None = None,
    dataset: str | None = None,
    dataset_hash: str | None = None,
    config: dict[str, Any] | None = None,
    started_at: datetime | None = None,
    notes: str | None = None,
    status: str = "running",
    series: str | None = None,
    image_id: str | None = None,
) -> dict[str, Any]:
    """Record (or re-record) a run's row; returns the row as stored.

    `series` names the schedule the run belongs to (a deployment's name); with the task
    set's hash and the model it decides which runs are compared night to night.
    """
    check_run_id(run_id)
    if status not in RUN_STATUSES:
        raise ValueError(f"run status {status!r} is not one of {', '.join(RUN_STATUSES)}")
    if config is not None and not isinstance(config, dict):
        raise TypeError(
            f"run config must be a dict (e.g. Settings.public_dict()), not {type(config).__name__}"
        )
    row = {
        "run_id": run_id,
        "started_at": utc(started_at) or now_utc(),
        "ended_at": None,
        "status": status,
        "model": model,
        "image": image,
        "dataset": dataset,
        "dataset_hash": dataset_hash,
        "config": dumps(scrub(config or {})),
        "host": f"{getpass.getuser()}@{socket.gethostname()}",
        "sandflow_version": _sandflow_version(),
        "notes": notes,
        "written_at": now_utc(),
        "series": series,
        "image_id": image_id,
    }
    write_parquet_atomic(rows_table("runs", [row]), layout.run_file(run_id))
    return row


def read_run(layout: Layout, run_id: str) -> dict[str, Any] | None:
    path = layout.run_file(run_id)
    if not path.exists():
        return None
    rows = pq.read_table(path).to_pylist()
    return rows[0] if rows else None


def finish_run(
    layout: Layout,
    run_id: str,
    *,
    status: str = "finished",
    ended_at: datetime | None = None,
    notes: str | None = None,
) -> dict[str, Any]:
    """Mark a run ended. A run never started with write_run gets a row now."""
    if status not in RUN_STATUSES:
        raise ValueError(f"run status {status!r} is not one of {', '.join(RUN_STATUSES)}")
    row = read_run(layout, run_id) or write_run(layout, run_id)
    row = dict(row)
    row.update(status=status, ended_at=utc(ended_at) or now_utc(), written_at=now_utc())
    if notes is not None:
        row["notes"] = notes
    write_parquet_atomic(rows_table("runs", [row]), layout.run_file(run_id))
    return row
