"""Scores and sandbox-usage labels: rows the flows' score/usage steps write.

Each `write_scores` / `write_usage` call writes one batch file (atomically). Re-scoring is
idempotent at read time: for each (episode_id, verifier) the views keep only the rows of
the newest batch, and for each (episode_id, labeler) the newest usage batch, so a re-run
of a verifier or a labeler replaces its earlier answer, even if it now emits fewer rows.

A score names the recording attempt it judged (`episode_write_id`, the episode row's
write_id). When the episode is recorded again (a resumed run re-running it), the old score
judged an answer that no longer exists: the `scores` view leaves it out (`stale_scores`
shows it) until the episode is scored again. Rows without an attempt (older files, callers
that do not know it) are stale when scored before the episode's current row was written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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


def _write_batch(
    layout: Layout,
    table: str,
    items: list[Any],
    row: Callable[[Any], dict[str, Any]],
    *,
    stamp: tuple[str, datetime | None],
) -> Path:
    """One run's label rows as a new batch file of `table` (`row`: an item's columns, its
    model's own fields where they are stored as they are): every row carries the batch id
    and the time in the column `stamp` names (given, or now). Scores and usage labels are
    both written so; the views keep the newest batch."""
    run_id = _one_run(items, table)
    batch_id = new_id()
    column, at = stamp
    ts = utc(at) or now_utc()
    rows = [{**row(r), "batch_id": batch_id, column: ts} for r in items]
    return write_parquet_atomic(rows_table(table, rows), layout.batch_file(table, run_id, batch_id))


def write_scores(
    layout: Layout,
    rows: Iterable[ScoreRow | Mapping[str, Any]],
    *,
    scored_at: datetime | None = None,
) -> Path | None:
    """Store score rows (one run per call); returns the batch file, None if no rows."""
    items: list[ScoreRow] = _coerce(ScoreRow, rows, "scores")
    if not items:
        return None
    return _write_batch(
        layout,
        "scores",
        items,
        lambda r: {
            **r.model_dump(exclude={"ground_truth", "details"}),
            "ground_truth": None
            if r.ground_truth is None
            else (r.ground_truth if isinstance(r.ground_truth, str) else dumps(r.ground_truth)),
            "details": dumps(scrub(r.details)) if r.details else None,
        },
        stamp=("scored_at", scored_at),
    )


def write_usage(
    layout: Layout,
    rows: Iterable[UsageRow | Mapping[str, Any]],
    *,
    labeled_at: datetime | None = None,
) -> Path | None:
    """Store usage labels (one run per call); returns the batch file, None if no rows."""
    items: list[UsageRow] = _coerce(UsageRow, rows, "usage")
    if not items:
        return None
    for i, r in enumerate(items):
        if r.capability not in CAPABILITIES:
            raise ValueError(
                f"usage row {i}: capability {r.capability!r} is not one of {', '.join(CAPABILITIES)}"
            )
    return _write_batch(
        layout,
        "usage",
        items,
        lambda r: r.model_dump(),
        stamp=("labeled_at", labeled_at),
    )
