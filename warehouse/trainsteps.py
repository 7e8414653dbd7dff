"""Training steps in the warehouse: one batch file per write (`train_steps`).

A trainer (rl/train.py) hands one row per optimizer step: what it logged (loss, KL,
gradient norm, learning rate, reward as it saw it, tokens) and where the step's time went
(generation, sandboxes, reward, optimizer). The `training_steps` view (warehouse/views.py)
joins them with the step's rollouts, the episodes tagged with the same training run and
step, for the verifier's reward, its spread and the pass rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from warehouse.convert import now_utc, rows_table
from warehouse.layout import Layout, new_id, write_parquet_atomic
from warehouse.schema import TRAIN_STEPS, check_run_id

_FIELDS = frozenset(TRAIN_STEPS.names) - {"run_id", "batch_id", "recorded_at"}


def write_train_steps(layout: Layout, run_id: str, rows: Iterable[Mapping[str, Any]]) -> Path:
    check_run_id(run_id)
    batch_id = new_id()
    ts = now_utc()
    out = []
    for i, row in enumerate(rows):
        extra = set(row) - _FIELDS
        if extra:
            raise ValueError(f"train_steps row {i}: unknown field(s) {sorted(extra)}")
        if not row.get("training_run") or row.get("step") is None:
            raise ValueError(f"train_steps row {i}: training_run and step are required")
        out.append({**row, "run_id": run_id, "batch_id": batch_id, "recorded_at": ts})
    return write_parquet_atomic(rows_table("train_steps", out), layout.batch_file("train_steps", run_id, batch_id))
