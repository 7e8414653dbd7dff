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

from warehouse.convert import write_batch
from warehouse.layout import Layout


def write_train_steps(layout: Layout, run_id: str, rows: Iterable[Mapping[str, Any]]) -> Path:
    def prepare(i: int, row: Mapping[str, Any]) -> Mapping[str, Any]:
        if not row.get("training_run") or row.get("step") is None:
            raise ValueError(f"train_steps row {i}: training_run and step are required")
        return row

    return write_batch(layout, "train_steps", run_id, rows, prepare=prepare)
