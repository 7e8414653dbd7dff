"""Records (tasks.records) <-> the warehouse's rows, both directions in one place.

Writing: records -> Arrow tables in the warehouse schemas, built column-wise rather than
row dict by row dict (an episode of 100 turns converts in about a millisecond, which keeps
`finish_episode` cheap for the agent loop). Reading: a view's row -> the record it stores
(`episode_record`, `turn_record`), so readers get the same contract types back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa

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
from warehouse.schema import EGRESS, META_PROMPT_DELTAS, OBSERVATION, TOOL_CALL, schema_for


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
    return pa.array(micros, pa.int64()).cast(pa.timestamp("us", tz="UTC"))


def now_utc() -> datetime:
    return datetime.now(UTC)


def dumps(obj: Any) -> str | None:
    if obj is None:
        return None
    return json.dumps(obj, ensure_ascii=False, default=str, separators=(",", ":"))


def prompt_id_deltas(
    turns: Sequence[TurnRecord],
) -> tuple[list[list[int] | None], list[int | None]]:
    """Each turn's prompt ids minus the previous turn's prompt, when that is their prefix.

    Why: the chat history is append-only, so turn i's prompt ids start with turn i-1's;
    storing them in full is quadratic in the turns. Returns the ids to store and, per
    turn, how many leading ids were left out (None: stored in full). `turns` is sorted by
    turn_index; with a repeated index nothing is left out (the chain would be ambiguous).
    The `turns` view puts the full ids back (warehouse.query.FULL_PROMPT_IDS).
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
    tool_calls = [
        [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in t.tool_calls]
        for t in turns
    ]
    observations = [
        [
            {
                "tool_call_id": o.tool_call_id,
                "name": o.name,
                "content": o.content,
                "exit_code": o.exit_code,
                "timed_out": o.timed_out,
                "oom_killed": o.oom_killed,
                "truncated": o.truncated,
                "error": o.error,
                "duration_s": o.duration_s,
            }
            for o in t.observations
        ]
        for t in turns
    ]
    egress = [
        [
            {
                **e.model_dump(exclude={"time", "url"}),
                "time": utc(e.time),
                "url": None if e.url is None else scrub(e.url),
            }
            for e in t.egress
        ]
        or None
        for t in turns
    ]
    schema = schema_for("turns")
    if any(n is not None for n in prefix_len):
        schema = schema.with_metadata({**(schema.metadata or {}), META_PROMPT_DELTAS: b"1"})
    cols: dict[str, pa.Array] = {
        "run_id": pa.array([t.run_id for t in turns], pa.string()),
        "episode_id": pa.array([t.episode_id for t in turns], pa.string()),
        "write_id": pa.array([write_id] * len(turns), pa.string()),
        "turn_index": pa.array([t.turn_index for t in turns], pa.int32()),
        "started_at": ts_array([t.started_at for t in turns]),
        "assistant_content": pa.array([t.assistant_content for t in turns], pa.string()),
        "reasoning_content": pa.array([t.reasoning_content for t in turns], pa.string()),
        "tool_calls": pa.array(tool_calls, pa.list_(TOOL_CALL)),
        "observations": pa.array(observations, pa.list_(OBSERVATION)),
        "num_tool_calls": pa.array([len(t.tool_calls) for t in turns], pa.int32()),
        "extra_messages": pa.array(
            [dumps(t.extra_messages) if t.extra_messages else None for t in turns], pa.string()
        ),
        "finish_reason": pa.array([t.finish_reason for t in turns], pa.string()),
        "model_latency_s": pa.array([t.model_latency_s for t in turns], pa.float64()),
        "tool_latency_s": pa.array([t.tool_latency_s for t in turns], pa.float64()),
        "prompt_tokens": pa.array([t.usage.prompt_tokens for t in turns], pa.int64()),
        "completion_tokens": pa.array([t.usage.completion_tokens for t in turns], pa.int64()),
        "cached_tokens": pa.array([t.usage.cached_tokens for t in turns], pa.int64()),
        "reasoning_tokens": pa.array([t.usage.reasoning_tokens for t in turns], pa.int64()),
        "prompt_token_ids": pa.array(prompt_ids, pa.list_(pa.int32())),
        "completion_token_ids": pa.array(
            [t.completion_token_ids for t in turns], pa.list_(pa.int32())
        ),
        "completion_logprobs": pa.array(
            [t.completion_logprobs for t in turns], pa.list_(pa.float64())
        ),
        "error": pa.array([t.error for t in turns], pa.string()),
        "request_max_tokens": pa.array([t.request_max_tokens for t in turns], pa.int32()),
        "attempts": pa.array([t.attempts for t in turns], pa.int32()),
        "prompt_token_ids_prefix_len": pa.array(prefix_len, pa.int32()),
        "egress": pa.array(egress, pa.list_(EGRESS)),
    }
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def episode_row(
    ep: EpisodeRecord, write_id: str, written_at: datetime | None = None
) -> dict[str, Any]:
    return {
        "run_id": ep.run_id,
        "episode_id": ep.episode_id,
        "write_id": write_id,
        "task_id": ep.task_id,
        "domain": ep.domain,
        "mode": ep.mode,
        "sample_index": ep.sample_index,
        "model": ep.model,
        "started_at": utc(ep.started_at),
        "ended_at": utc(ep.ended_at),
        "termination": ep.termination,
        "is_infra_failure": ep.termination in INFRA_TERMINATIONS,
        "error": ep.error,
        "answer": ep.answer,
        "prompt_messages": dumps(scrub(ep.prompt_messages)),
        "num_turns": ep.num_turns,
        "prompt_tokens": ep.prompt_tokens,
        "completion_tokens": ep.completion_tokens,
        "cached_tokens": ep.cached_tokens,
        "wall_s": ep.wall_s,
        "model_s": ep.model_s,
        "tool_s": ep.tool_s,
        "config": dumps(scrub(ep.config)),
        "written_at": written_at or now_utc(),
        "reasoning_tokens": ep.reasoning_tokens,
        "answer_source": ep.answer_source,
        "training_run": ep.training_run,
        "training_step": ep.training_step,
        "policy_version": ep.policy_version,
        "token_ids_status": ep.token_ids_status,
        "output_export": None if ep.output_export is None else dumps(scrub(ep.output_export)),
    }


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
def _loads(text: str | None, default: Any) -> Any:
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


def episode_record(r: dict[str, Any]) -> EpisodeRecord:
    """A row of the `episodes` view -> the EpisodeRecord it stores."""
    return EpisodeRecord(
        run_id=r["run_id"],
        episode_id=r["episode_id"],
        task_id=r["task_id"] or "",
        domain=r["domain"] or "",
        mode=r["mode"] or "sandbox",
        sample_index=r["sample_index"] or 0,
        model=r["model"] or "",
        started_at=r["started_at"],
        ended_at=r["ended_at"],
        termination=r["termination"],
        error=r["error"],
        answer=r["answer"],
        prompt_messages=_loads(r.get("prompt_messages"), []),
        num_turns=r["num_turns"] or 0,
        prompt_tokens=r["prompt_tokens"] or 0,
        completion_tokens=r["completion_tokens"] or 0,
        cached_tokens=r["cached_tokens"] or 0,
        wall_s=r["wall_s"] or 0.0,
        model_s=r["model_s"] or 0.0,
        tool_s=r["tool_s"] or 0.0,
        config=_loads(r.get("config"), {}),
        reasoning_tokens=r.get("reasoning_tokens") or 0,
        answer_source=r.get("answer_source"),
    )


def turn_record(r: dict[str, Any]) -> TurnRecord:
    """A row of the `turns` view -> the TurnRecord it stores."""
    return TurnRecord(
        run_id=r["run_id"],
        episode_id=r["episode_id"],
        turn_index=r["turn_index"],
        started_at=r["started_at"],
        assistant_content=r["assistant_content"],
        reasoning_content=r["reasoning_content"],
        tool_calls=[ToolCall(**c) for c in (r["tool_calls"] or [])],
        observations=[
            Observation(**{k: v for k, v in o.items() if v is not None or k in ("exit_code", "error")})
            for o in (r["observations"] or [])
        ],
        extra_messages=_loads(r.get("extra_messages"), []),
        finish_reason=r["finish_reason"],
        model_latency_s=r["model_latency_s"] or 0.0,
        tool_latency_s=r["tool_latency_s"] or 0.0,
        usage=Usage(
            prompt_tokens=r["prompt_tokens"],
            completion_tokens=r["completion_tokens"],
            cached_tokens=r["cached_tokens"],
            reasoning_tokens=r.get("reasoning_tokens"),
        ),
        prompt_token_ids=r["prompt_token_ids"],
        completion_token_ids=r["completion_token_ids"],
        completion_logprobs=r["completion_logprobs"],
        error=r["error"],
        request_max_tokens=r.get("request_max_tokens"),
        attempts=r.get("attempts") or 1,
        egress=[EgressRequest(**x) for x in (r.get("egress") or [])],
    )
