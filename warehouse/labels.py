"""Scores and sandbox-usage labels: rows the flows' score/usage steps write.

Each `write_labels` call (Warehouse.write_scores / write_usage) writes one batch file
(atomically). Re-scoring is idempotent at read time: for each (episode_id, verifier) the
views keep only the rows of the newest batch, and for each (episode_id, labeler) the newest
usage batch, so a re-run of a verifier or a labeler replaces its earlier answer, even if it
now emits fewer rows.

A score names the recording attempt it judged (`episode_write_id`, the episode row's
write_id). When the episode is recorded again (a resumed run re-running it), the old score
judged an answer that no longer exists: the `scores` view leaves it out (`stale_scores`
shows it) until the episode is scored again. Rows without an attempt (older files, callers
that do not know it) are stale when scored before the episode's current row was written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from datasets_prep.secrets import scrub
from warehouse.convert import dumps, now_utc, rows_table, utc
from warehouse.layout import Layout, new_id, write_parquet_atomic
from warehouse.schema import check_run_id

CAPABILITIES = ("computation", "file_management", "external_resource", "none")


class ScoreRow(BaseModel):
    """One verifier's verdict on one episode."""

    run_id: str
    episode_id: str
    verifier: str
    score: float | None = Field(None, description="0..1; None when the episode was not gradable")
    passed: bool | None = None
    reason: str | None = None
    answer: str | None = None
    ground_truth: Any = None
    details: dict[str, Any] = Field(default_factory=dict)
    episode_write_id: str | None = Field(
        None,
        description="write_id of the episode attempt scored; None: judged by scored_at instead",
    )


class UsageRow(BaseModel):
    """One capability label of one tool call (or turn) of an episode."""

    run_id: str
    episode_id: str
    turn_index: int
    call_index: int | None = None
    capability: str
    tool: str | None = None
    detail: str | None = None
    labeler: str = "rules"


def _coerce(
    model: type[BaseModel], rows: Iterable[BaseModel | Mapping[str, Any]], what: str
) -> list[Any]:
    out = []
    for i, r in enumerate(rows):
        if isinstance(r, model):
            out.append(r)
            continue
        try:
            out.append(model.model_validate(r))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{what} row {i}: field {field!r}: {first['msg']}") from None
    return out


def _one_run(rows: list[Any], what: str) -> str:
    runs = {r.run_id for r in rows}
    if len(runs) != 1:
        raise ValueError(f"{what}: one batch holds rows of one run; got runs {sorted(runs)}")
    return check_run_id(runs.pop())


def _score_columns(r: ScoreRow) -> dict[str, Any]:
    """A score's stored columns: the ground truth as text (JSON unless it is text), the
    details as JSON with secrets scrubbed."""
    return {
        **r.model_dump(exclude={"ground_truth", "details"}),
        "ground_truth": None
        if r.ground_truth is None
        else (r.ground_truth if isinstance(r.ground_truth, str) else dumps(r.ground_truth)),
        "details": dumps(scrub(r.details)) if r.details else None,
    }


def _check_capabilities(items: list[UsageRow]) -> None:
    for i, r in enumerate(items):
        if r.capability not in CAPABILITIES:
            raise ValueError(
                f"usage row {i}: capability {r.capability!r} is not one of {', '.join(CAPABILITIES)}"
            )


@dataclass(frozen=True)
class _Labels:
    """A kind of label rows: its table, its row model, how a row is stored, the column
    that holds the batch's time, and what else a row must satisfy."""

    table: str
    model: type[BaseModel]
    columns: Callable[[Any], dict[str, Any]]
    stamp: str
    check: Callable[[list[Any]], None] | None = None


KINDS: dict[str, _Labels] = {
    "scores": _Labels("scores", ScoreRow, _score_columns, "scored_at"),
    "usage": _Labels("usage", UsageRow, lambda r: r.model_dump(), "labeled_at", _check_capabilities),
}


def write_labels(
    layout: Layout,
    kind: str,
    rows: Iterable[BaseModel | Mapping[str, Any]],
    at: datetime | None = None,
) -> Path | None:
    """Store one run's label rows of `kind` ("scores" or "usage") as a new batch file of
    its table (atomically); returns the file, None if no rows. Every row carries the batch
    id and the time `at` (default now) in the kind's stamp column; the views keep the
    newest batch."""
    labels = KINDS[kind]
    items = _coerce(labels.model, rows, labels.table)
    if not items:
        return None
    if labels.check is not None:
        labels.check(items)
    run_id = _one_run(items, labels.table)
    batch_id = new_id()
    ts = utc(at) or now_utc()
    out = [{**labels.columns(r), "batch_id": batch_id, labels.stamp: ts} for r in items]
    return write_parquet_atomic(rows_table(labels.table, out), layout.batch_file(labels.table, run_id, batch_id))
