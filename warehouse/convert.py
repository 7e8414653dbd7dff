"""Records (tasks.records) <-> the warehouse's rows, both directions in one place.

Writing: records -> Arrow tables in the warehouse schemas, built column-wise rather than
row dict by row dict (an episode of 100 turns converts in about a millisecond, which keeps
`finish_episode` cheap for the agent loop). Reading: a view's row -> the record it stores
(`episode_record`, `turn_record`), so readers get the same contract types back. Both
directions follow the column tables of warehouse/fields.py: nothing here names a field
except what the writer itself gives (write_id, written_at, prompt ids stored as deltas).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from tasks.records import EpisodeRecord, TurnRecord
from warehouse import fields
from warehouse.fields import dumps as dumps
from warehouse.fields import ts_array as ts_array
from warehouse.fields import utc as utc
from warehouse.layout import Layout, new_id, write_parquet_atomic
from warehouse.schema import META_PROMPT_DELTAS, check_run_id, schema_for


def now_utc() -> datetime:
    return datetime.now(UTC)


def prompt_id_deltas(
    turns: Sequence[TurnRecord],
) -> tuple[list[list[int] | None], list[int | None]]:
    """Each turn's prompt ids minus the previous turn's prompt, when that is their prefix.

    Why: the chat history is append-only, so turn i's prompt ids start with turn i-1's;
    storing them in full is quadratic in the turns. Returns the ids to store and, per
    turn, how many leading ids were left out (None: stored in full). `turns` is sorted by
    turn_index; with a repeated index nothing is left out (the chain would be ambiguous).
    The `turns` view puts the full ids back (warehouse.views.FULL_PROMPT_IDS).
    """
    stored: list[list[int] | None] = [t.prompt_token_ids for t in turns]
    prefix: list[int | None] = [None] * len(turns)
    if len({t.turn_index for t in turns}) != len(turns):
        return stored, prefix
    for i in range(1, len(turns)):
        prev, ids = turns[i - 1].prompt_token_ids, turns[i].prompt_token_ids
        if prev and ids is not None and len(ids) >= len(prev) and ids[: len(prev)] == prev:
            stored[i] = ids[len(prev) :]
            prefix[i] = len(prev)
    return stored, prefix


def turns_table(
    turns: Sequence[TurnRecord], write_id: str, *, prompt_deltas: bool = False
) -> pa.Table:
    """One episode's turns, sorted by turn_index, as a table in the `turns` schema.

    prompt_deltas: store each turn's prompt ids as a delta on the previous turn's
    (`prompt_token_ids_prefix_len` says how many ids it shares); committed episodes are
    written so, journals' partial turns are not.
    """
    turns = sorted(turns, key=lambda t: t.turn_index)
    if prompt_deltas:
        prompt_ids, prefix_len = prompt_id_deltas(turns)
    else:
        prompt_ids, prefix_len = [t.prompt_token_ids for t in turns], [None] * len(turns)
    schema = schema_for("turns")
    if any(n is not None for n in prefix_len):
        schema = schema.with_metadata({**(schema.metadata or {}), META_PROMPT_DELTAS: b"1"})
    given: dict[str, list[Any]] = {
        "write_id": [write_id] * len(turns),
        "prompt_token_ids": prompt_ids,
        "prompt_token_ids_prefix_len": prefix_len,
    }
    arrays = [
        fields.array(col, given[col.name] if col.name in given else fields.values(col, turns))
        for col in fields.TURN_COLUMNS
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def episode_row(
    ep: EpisodeRecord, write_id: str, written_at: datetime | None = None
) -> dict[str, Any]:
    """An episode's row in the `episodes` schema (fields.EPISODE_COLUMNS)."""
    given: dict[str, Any] = {"write_id": write_id, "written_at": written_at or now_utc()}
    row: dict[str, Any] = {}
    for col in fields.EPISODE_COLUMNS:
        if col.name in given:
            row[col.name] = given[col.name]
        else:
            row[col.name] = col.get(ep)
        if col.type == fields.TS:
            row[col.name] = utc(row[col.name])
    return row


def rows_table(table: str, rows: Iterable[dict[str, Any]]) -> pa.Table:
    """Rows (dicts) -> a table in `table`'s schema; a bad row gets a message naming it."""
    schema = schema_for(table)
    rows = list(rows)
    names = schema.names
    for i, row in enumerate(rows):
        extra = set(row) - set(names)
        if extra:
            raise ValueError(
                f"{table} row {i}: unknown field(s) {sorted(extra)}; allowed: {', '.join(names)}"
            )
        for f in schema:
            if not f.nullable and row.get(f.name) is None:
                raise ValueError(f"{table} row {i}: field {f.name!r} is required")
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        # Find the row and field that does not fit, so the caller knows what to fix.
        for i, row in enumerate(rows):
            for f in schema:
                try:
                    pa.array([row.get(f.name)], f.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError) as cell_exc:
                    raise ValueError(
                        f"{table} row {i}: field {f.name!r} = {row.get(f.name)!r} "
                        f"does not fit type {f.type} ({cell_exc})"
                    ) from exc
        raise ValueError(f"{table}: rows do not fit the schema ({exc})") from exc


# ------------------------------------------------------------------ rows -> records
def episode_record(r: dict[str, Any]) -> EpisodeRecord:
    """A row of the `episodes` view -> the EpisodeRecord it stores."""
    return EpisodeRecord(**fields.record_kwargs(fields.EPISODE_COLUMNS, r))


def turn_record(r: dict[str, Any]) -> TurnRecord:
    """A row of the `turns` view -> the TurnRecord it stores."""
    return TurnRecord(**fields.record_kwargs(fields.TURN_COLUMNS, r))


def write_batch(
    layout: Layout,
    table: str,
    run_id: str,
    rows: Iterable[Mapping[str, Any]],
    *,
    stamp: Mapping[str, Any] | None = None,
    prepare: Callable[[int, Mapping[str, Any]], Mapping[str, Any]] | None = None,
    also: Iterable[Mapping[str, Any]] = (),
) -> Path:
    """Store `rows` as one new batch file of `table` in `run_id`'s partition (atomically).

    Every row gets the batch's stamp: run_id, `stamp`'s columns, a new batch_id and
    recorded_at (now); a row naming a stamped column, or one the table does not have, is
    refused, naming the row. `prepare(i, row)` checks a row (ValueError naming it) and
    returns what is stored; `also`: rows of the writer's own (a marker), stamped as is."""
    check_run_id(run_id)
    batch_id = new_id()
    stamped = {"run_id": run_id, **(stamp or {}), "batch_id": batch_id, "recorded_at": now_utc()}
    allowed = frozenset(schema_for(table).names) - set(stamped)
    out = []
    for i, row in enumerate(rows):
        extra = set(row) - allowed
        if extra:
            raise ValueError(f"{table} row {i}: unknown field(s) {sorted(extra)}")
        out.append({**(prepare(i, row) if prepare is not None else row), **stamped})
    out += [{**row, **stamped} for row in also]
    return write_parquet_atomic(rows_table(table, out), layout.batch_file(table, run_id, batch_id))
