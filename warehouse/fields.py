"""A stored record's fields, once: the column tables of `turns` and `episodes`.

Why: adding a field to a turn used to touch the record (tasks/records.py), the Arrow
schema (schema.py), the column builder and the reader (convert.py), the views and the
viewer. Now each column is declared here once, with its Arrow type, where its value
comes from in the record and how it is stored and read back; schema.py's TURNS and
EPISODES, convert.py's writers (`turns_table`, `episode_row`) and readers (`turn_record`,
`episode_record`) and the viewer's turn columns are all derived from these tables.

A field added to `TurnRecord` or `EpisodeRecord` with a plain type (str, int, float,
bool, datetime, lists of those, dicts or models) needs nothing here: `derived_columns`
gives it a column (appended after the declared ones, so old files keep reading: a
column only ever added), stored as is or, for dicts and models, as JSON text with
secrets scrubbed; the views select it (``SELECT *``) and it reads back into the record.
Declare a `Column` only when the default is not what should be stored (a narrower
integer, a nested struct, a value taken from elsewhere or computed).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from operator import attrgetter
from typing import Any

import pyarrow as pa
from pydantic import BaseModel

from datasets_prep.secrets import scrub
from tasks.records import (
    INFRA_TERMINATIONS,
    EgressRequest,
    EpisodeRecord,
    Observation,
    ToolCall,
    TurnRecord,
    Usage,
)

TS = pa.timestamp("us", tz="UTC")

TOOL_CALL = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("name", pa.string()),
        pa.field("arguments", pa.string()),
    ]
)

OBSERVATION = pa.struct(
    [
        pa.field("tool_call_id", pa.string()),
        pa.field("name", pa.string()),
        pa.field("content", pa.string()),
        pa.field("exit_code", pa.int32()),
        pa.field("timed_out", pa.bool_()),
        pa.field("oom_killed", pa.bool_()),
        pa.field("truncated", pa.bool_()),
        pa.field("error", pa.string()),
        pa.field("duration_s", pa.float64()),
    ]
)

# One request through the egress proxy (tasks.records.EgressRequest); `egress` view.
EGRESS = pa.struct(
    [
        pa.field("time", TS),
        pa.field("method", pa.string()),
        pa.field("host", pa.string()),
        pa.field("port", pa.int32()),
        pa.field("url", pa.string()),
        pa.field("status", pa.int32()),
        pa.field("bytes_out", pa.int64()),
        pa.field("bytes_in", pa.int64()),
        pa.field("allowed", pa.bool_()),
        pa.field("rule", pa.string()),
        pa.field("result", pa.string()),
    ]
)


# ------------------------------------------------------------------------ conversions
def utc(ts: datetime | None) -> datetime | None:
    """Naive datetimes are taken as UTC (what the agent loop records)."""
    if ts is None:
        return None
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def ts_array(values: Sequence[datetime | None]) -> pa.Array:
    """Datetimes -> timestamp[us, UTC] without pyarrow's pandas-backed conversion path."""
    micros = [None if v is None else (utc(v) - _EPOCH) // _US for v in values]  # type: ignore[operator]
    return pa.array(micros, pa.int64()).cast(TS)


def dumps(obj: Any) -> str | None:
    if obj is None:
        return None
    return json.dumps(obj, ensure_ascii=False, default=str, separators=(",", ":"))


def loads(text: str | None, default: Any = None) -> Any:
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


def _json(v: Any) -> str | None:
    """Free-form data as JSON text, secrets scrubbed (models dumped first)."""
    if isinstance(v, BaseModel):
        v = v.model_dump(mode="json")
    elif isinstance(v, list):
        v = [x.model_dump(mode="json") if isinstance(x, BaseModel) else x for x in v]
    return None if v is None else dumps(scrub(v))


# ------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Column:
    """One stored column of a record table.

    source: the record's attribute it holds (dotted for nested: ``usage.prompt_tokens``);
        None: not a record field (given by the writer, e.g. write_id, or computed by
        `compute` from the record).
    store: record value -> stored value (default: as is).
    load: stored value -> record value when a row is read back (default: as is).
    missing: the record value for a NULL (default: the record's own default).
    read_back=False: never read back (derived data).
    """

    name: str
    type: pa.DataType
    nullable: bool = True
    source: str | None = ""  # "": the column's own name
    store: Callable[[Any], Any] | None = None
    compute: Callable[[Any], Any] | None = None
    load: Callable[[Any], Any] | None = None
    missing: Any = None
    read_back: bool = True

    @property
    def attr(self) -> str | None:
        return self.name if self.source == "" else self.source

    @cached_property
    def get(self) -> Callable[[Any], Any]:
        """record -> the stored value (built once: the writers call it per row)."""
        if self.compute is not None:
            return self.compute
        assert self.attr, f"column {self.name} has no source: the writer gives its values"
        get = attrgetter(self.attr)
        store = self.store
        if store is None:
            return get
        return lambda r: store(get(r))

    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def _observations(obs: list[Observation]) -> list[dict[str, Any]]:
    return [
        {
            "tool_call_id": o.tool_call_id, "name": o.name, "content": o.content,
            "exit_code": o.exit_code, "timed_out": o.timed_out, "oom_killed": o.oom_killed,
            "truncated": o.truncated, "error": o.error, "duration_s": o.duration_s,
        }
        for o in obs
    ]  # fmt: skip


def _egress(reqs: list[EgressRequest]) -> list[dict[str, Any]] | None:
    out = [
        {
            **e.model_dump(exclude={"time", "url"}),
            "time": utc(e.time),
            "url": None if e.url is None else scrub(e.url),
        }
        for e in reqs
    ]
    return out or None


def _load_observation(o: dict[str, Any]) -> Observation:
    return Observation(
        **{k: v for k, v in o.items() if v is not None or k in ("exit_code", "error")}
    )


_I32, _I64, _F64, _STR = pa.int32(), pa.int64(), pa.float64(), pa.string()

# The turns table (one row per TurnRecord), in stored column order: new columns only at
# the end. prompt_token_ids / prompt_token_ids_prefix_len are given by the writer when it
# stores prompts as deltas (convert.prompt_id_deltas).
TURN_DECLARED: tuple[Column, ...] = (
    Column("run_id", _STR, nullable=False),
    Column("episode_id", _STR, nullable=False),
    Column("write_id", _STR, nullable=False, source=None),
    Column("turn_index", _I32, nullable=False),
    Column("started_at", TS),
    Column("assistant_content", _STR),
    Column("reasoning_content", _STR),
    Column("tool_calls", pa.list_(TOOL_CALL), store=_tool_calls,
           load=lambda v: [ToolCall(**c) for c in v]),
    Column("observations", pa.list_(OBSERVATION), store=_observations,
           load=lambda v: [_load_observation(o) for o in v]),
    # len(tool_calls), stored so counting calls never reads the nested text
    Column("num_tool_calls", _I32, source=None, compute=lambda t: len(t.tool_calls),
           read_back=False),
    Column("extra_messages", _STR, store=lambda v: dumps(v) if v else None,
           load=lambda v: loads(v, [])),  # JSON list
    Column("finish_reason", _STR),
    Column("model_latency_s", _F64),
    Column("tool_latency_s", _F64),
    Column("prompt_tokens", _I64, source="usage.prompt_tokens"),
    Column("completion_tokens", _I64, source="usage.completion_tokens"),
    Column("cached_tokens", _I64, source="usage.cached_tokens"),
    Column("reasoning_tokens", _I64, source="usage.reasoning_tokens"),
    Column("prompt_token_ids", pa.list_(_I32)),
    Column("completion_token_ids", pa.list_(_I32)),
    Column("completion_logprobs", pa.list_(_F64)),
    Column("error", _STR),
    Column("request_max_tokens", _I32),  # max_tokens sent (shrinks after a context error)
    Column("attempts", _I32),  # HTTP attempts of the model call (retries)
    # Leading prompt ids shared with the previous turn's prompt and not stored again
    # here: prompt_token_ids then holds only the new ids (the `turns` view rebuilds the
    # full list). NULL: stored in full (first turn, a changed prefix, older files).
    Column("prompt_token_ids_prefix_len", _I32, source=None, read_back=False),
    # requests through the egress proxy that ended during this turn (network allowlist)
    Column("egress", pa.list_(EGRESS), store=_egress,
           load=lambda v: [EgressRequest(**x) for x in v]),
)  # fmt: skip

EPISODE_DECLARED: tuple[Column, ...] = (
    Column("run_id", _STR, nullable=False),
    Column("episode_id", _STR, nullable=False),
    Column("write_id", _STR, nullable=False, source=None),  # one recording attempt
    Column("task_id", _STR, missing=""),
    Column("domain", _STR, missing=""),
    Column("mode", _STR, missing="sandbox"),
    Column("sample_index", _I32),
    Column("model", _STR, missing=""),
    Column("started_at", TS),
    Column("ended_at", TS),
    Column("termination", _STR),
    Column("is_infra_failure", pa.bool_(), source=None,
           compute=lambda e: e.termination in INFRA_TERMINATIONS, read_back=False),
    Column("error", _STR),
    Column("answer", _STR),
    Column("prompt_messages", _STR, store=_json, load=lambda v: loads(v, [])),  # JSON list
    Column("num_turns", _I32),
    Column("prompt_tokens", _I64),
    Column("completion_tokens", _I64),
    Column("cached_tokens", _I64),
    Column("wall_s", _F64),
    Column("model_s", _F64),
    Column("tool_s", _F64),
    Column("config", _STR, store=_json, load=lambda v: loads(v, {})),  # JSON, secrets removed
    Column("written_at", TS, source=None, read_back=False),
    Column("reasoning_tokens", _I64),
    Column("answer_source", _STR),  # answer_file | submit_argument | last_message | reply
    # RL rollouts (NULL for other runs and in older files): the trainer's run, step and
    # policy version, and whether the turns' token ids form one exact sequence.
    Column("training_run", _STR),
    Column("training_step", _I64),
    Column("policy_version", _STR),
    Column("token_ids_status", _STR),  # exact | missing | mismatch at turn N: why
    # JSON: the output folder's export: files, bytes, skipped counts per reason + examples
    Column("output_export", _STR, store=_json, load=lambda v: loads(v, None)),
)  # fmt: skip


# ------------------------------------------------------------------------ derivation
_SCALARS: dict[Any, pa.DataType] = {
    str: _STR, int: _I64, float: _F64, bool: pa.bool_(), datetime: TS,
}  # fmt: skip


def _arrow_type(annotation: Any) -> tuple[pa.DataType, bool] | None:
    """(Arrow type, stored as JSON) for a field's annotation; None if there is none."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _arrow_type(args[0])
    if origin is typing.Literal:
        return (_STR, False) if all(isinstance(a, str) for a in args) else None
    if annotation in _SCALARS:
        return _SCALARS[annotation], False
    if origin is list and len(args) == 1 and args[0] in _SCALARS and args[0] is not datetime:
        return pa.list_(_SCALARS[args[0]]), False
    if (
        origin in (dict, list)
        or annotation is Any
        or (isinstance(annotation, type) and issubclass(annotation, BaseModel))
    ):
        return _STR, True
    return None


def derived_columns(model: type[BaseModel], declared: Sequence[Column]) -> tuple[Column, ...]:
    """Columns for `model`'s fields that `declared` does not hold: a field added to the
    record is stored (and read back) without touching anything else."""
    held = {c.attr.split(".")[0] for c in declared if c.attr} | {c.name for c in declared}
    out = []
    for name, info in model.model_fields.items():
        if name in held:
            continue
        found = _arrow_type(info.annotation)
        if found is None:
            raise TypeError(
                f"{model.__name__}.{name}: no Arrow type for {info.annotation!r}; declare its "
                "Column in warehouse/fields.py"
            )
        arrow, as_json = found
        if as_json:
            out.append(Column(name, arrow, store=_json, load=loads))
        else:
            out.append(Column(name, arrow))
    return tuple(out)


def turn_columns(model: type[TurnRecord] = TurnRecord) -> tuple[Column, ...]:
    return TURN_DECLARED + derived_columns(model, TURN_DECLARED)


def episode_columns(model: type[EpisodeRecord] = EpisodeRecord) -> tuple[Column, ...]:
    return EPISODE_DECLARED + derived_columns(model, EPISODE_DECLARED)


TURN_COLUMNS = turn_columns()
EPISODE_COLUMNS = episode_columns()


def schema_of(columns: Sequence[Column]) -> pa.Schema:
    return pa.schema([c.field() for c in columns])


# ------------------------------------------------------------------------ records <-> columns
def values(col: Column, records: Sequence[Any]) -> list[Any]:
    """The stored values of `col` for `records`."""
    get = col.get
    return [get(r) for r in records]


def array(col: Column, vals: Sequence[Any]) -> pa.Array:
    if col.type == TS:
        return ts_array(vals)
    return pa.array(vals, col.type)


def record_kwargs(columns: Sequence[Column], row: dict[str, Any]) -> dict[str, Any]:
    """A stored row -> keyword arguments of its record (nested sources grouped: `usage`).

    A NULL leaves the record's default unless the column names a `missing` value."""
    out: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for col in columns:
        attr = col.attr
        if not attr or not col.read_back or col.name not in row:
            continue
        v = row[col.name]
        if v is None:
            if col.missing is None:
                continue
            v = col.missing
        elif col.load is not None:
            v = col.load(v)
        head, _, rest = attr.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = v
        else:
            out[head] = v
    if "usage" in nested:
        out["usage"] = Usage(**nested.pop("usage"))
    assert not nested, f"no record type for nested columns {sorted(nested)}"
    return out
