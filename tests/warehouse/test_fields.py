"""A record's fields once (issue #23): warehouse/fields.py is the one definition.

The Arrow schemas of `turns` and `episodes`, the writers' column builders, the readers
and the viewer's turn columns all derive from the column tables of warehouse/fields.py,
and a field added to TurnRecord / EpisodeRecord with a plain type gets its column from
the record itself. Here a field added in that one place (a record subclass, so the real
records stay as they are) is written to Parquet by the real writer, shows in the views
(NULL for a file written before it existed), is scrubbed of secrets when free-form, and
reads back into the record.

Real parts only: the warehouse writer, pyarrow, DuckDB.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import Field

from tasks.records import EpisodeRecord, TurnRecord
from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse, fields
from warehouse.convert import episode_record, turn_record
from warehouse.schema import SCHEMAS

# The stored columns as they were when this contract was written: columns are only ever
# added at the end, never renamed, retyped or moved (old files must keep reading).
TURNS_V1 = [
    ("run_id", "string"), ("episode_id", "string"), ("write_id", "string"),
    ("turn_index", "int32"), ("started_at", "timestamp[us, tz=UTC]"),
    ("assistant_content", "string"), ("reasoning_content", "string"),
    ("tool_calls", "list<item: struct<id: string, name: string, arguments: string>>"),
    ("observations", "list<item: struct<tool_call_id: string, name: string, content: string, "
     "exit_code: int32, timed_out: bool, oom_killed: bool, truncated: bool, error: string, "
     "duration_s: double>>"),
    ("num_tool_calls", "int32"), ("extra_messages", "string"), ("finish_reason", "string"),
    ("model_latency_s", "double"), ("tool_latency_s", "double"), ("prompt_tokens", "int64"),
    ("completion_tokens", "int64"), ("cached_tokens", "int64"), ("reasoning_tokens", "int64"),
    ("prompt_token_ids", "list<item: int32>"), ("completion_token_ids", "list<item: int32>"),
    ("completion_logprobs", "list<item: double>"), ("error", "string"),
    ("request_max_tokens", "int32"), ("attempts", "int32"),
    ("prompt_token_ids_prefix_len", "int32"),
    ("egress", "list<item: struct<time: timestamp[us, tz=UTC], method: string, host: string, "
     "port: int32, url: string, status: int32, bytes_out: int64, bytes_in: int64, "
     "allowed: bool, rule: string, result: string>>"),
]  # fmt: skip
EPISODES_V1 = [
    ("run_id", "string"), ("episode_id", "string"), ("write_id", "string"),
    ("task_id", "string"), ("domain", "string"), ("mode", "string"), ("sample_index", "int32"),
    ("model", "string"), ("started_at", "timestamp[us, tz=UTC]"),
    ("ended_at", "timestamp[us, tz=UTC]"), ("termination", "string"),
    ("is_infra_failure", "bool"), ("error", "string"), ("answer", "string"),
    ("prompt_messages", "string"), ("num_turns", "int32"), ("prompt_tokens", "int64"),
    ("completion_tokens", "int64"), ("cached_tokens", "int64"), ("wall_s", "double"),
    ("model_s", "double"), ("tool_s", "double"), ("config", "string"),
    ("written_at", "timestamp[us, tz=UTC]"), ("reasoning_tokens", "int64"),
    ("answer_source", "string"), ("training_run", "string"), ("training_step", "int64"),
    ("policy_version", "string"), ("token_ids_status", "string"), ("output_export", "string"),
]  # fmt: skip


def _shape(schema: pa.Schema) -> list[tuple[str, str]]:
    return [(f.name, str(f.type)) for f in schema]


def test_stored_columns_are_only_ever_added() -> None:
    assert _shape(SCHEMAS["turns"])[: len(TURNS_V1)] == TURNS_V1
    assert _shape(SCHEMAS["episodes"])[: len(EPISODES_V1)] == EPISODES_V1
    # the schemas are the column tables' (one definition)
    assert SCHEMAS["turns"].equals(fields.schema_of(fields.TURN_COLUMNS))
    assert SCHEMAS["episodes"].equals(fields.schema_of(fields.EPISODE_COLUMNS))


class TurnWithNote(TurnRecord):
    """A TurnRecord with fields added in the one place: the record."""

    note: str | None = None
    confidence: float | None = None
    tags: list[str] = Field(default_factory=list)
    meta: dict[str, Any] = Field(default_factory=dict)


class EpisodeWithJudge(EpisodeRecord):
    judge_model: str | None = None


def _add_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warehouse as it is when the records have the new fields."""
    turns, eps = fields.turn_columns(TurnWithNote), fields.episode_columns(EpisodeWithJudge)
    monkeypatch.setattr(fields, "TURN_COLUMNS", turns)
    monkeypatch.setattr(fields, "EPISODE_COLUMNS", eps)
    monkeypatch.setitem(SCHEMAS, "turns", fields.schema_of(turns))
    monkeypatch.setitem(SCHEMAS, "episodes", fields.schema_of(eps))


def test_a_field_added_to_the_record_is_stored_shown_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wh = Warehouse(tmp_path)
    with wh.writer(durability="flush") as w:  # before the fields existed
        ep, ts = make_episode("r1", "old", turns=2)
        record(w, ep, ts)

    _add_fields(monkeypatch)
    added = [c.name for c in fields.TURN_COLUMNS[len(TURNS_V1) :]]
    assert added == ["note", "confidence", "tags", "meta"]  # after egress, in record order
    ep, ts = make_episode("r1", "new", turns=2)
    ep = EpisodeWithJudge(**ep.model_dump(), judge_model="judge-7b")
    ts = [
        TurnWithNote(
            **t.model_dump(), note=f"n{t.turn_index}", confidence=0.5, tags=["a", "b"],
            meta={"k": t.turn_index, "api_key": "sk-live-abcdefghijklmnop"},
        )
        for t in ts
    ]  # fmt: skip
    with wh.writer(durability="flush") as w:
        record(w, ep, ts)

    # in the Parquet file, typed from the annotations
    (path,) = (tmp_path / "turns" / "run_id=r1").glob(f"{ep.episode_id}.*.parquet")
    table = pq.read_table(path)
    assert table.schema.field("note").type == pa.string()
    assert table.schema.field("confidence").type == pa.float64()
    assert table.schema.field("tags").type == pa.list_(pa.string())
    assert table.column("note").to_pylist() == ["n0", "n1"]
    assert "sk-live" not in str(table.column("meta").to_pylist())  # free-form: scrubbed

    # in the views: the old file's rows read as NULL
    with wh.query() as q:
        rows = q.rows(
            "SELECT e.task_id, t.turn_index, t.note, t.confidence, t.tags, t.meta->>'k', "
            "e.judge_model FROM turns t JOIN episodes e USING (run_id, episode_id) "
            "ORDER BY e.task_id, t.turn_index"
        )
    assert rows == [
        ("new", 0, "n0", 0.5, ["a", "b"], "0", "judge-7b"),
        ("new", 1, "n1", 0.5, ["a", "b"], "1", "judge-7b"),
        ("old", 0, None, None, None, None, None),
        ("old", 1, None, None, None, None, None),
    ]

    # and back into the record
    with wh.query() as q:
        t = q.arrow(f"SELECT * FROM turns WHERE episode_id = '{ep.episode_id}' AND turn_index = 1")
        e = q.arrow(f"SELECT * FROM episodes WHERE episode_id = '{ep.episode_id}'")
    kw = fields.record_kwargs(fields.TURN_COLUMNS, t.to_pylist()[0])
    back = TurnWithNote(**kw)
    assert (back.note, back.confidence, back.tags, back.meta["k"]) == ("n1", 0.5, ["a", "b"], 1)
    assert back.tool_calls == ts[1].tool_calls and back.usage == ts[1].usage
    kw = fields.record_kwargs(fields.EPISODE_COLUMNS, e.to_pylist()[0])
    assert EpisodeWithJudge(**kw).judge_model == "judge-7b"


def test_a_field_without_an_arrow_type_is_named() -> None:
    class Odd(TurnRecord):
        blob: bytes | None = None

    with pytest.raises(TypeError, match=r"Odd\.blob: no Arrow type .*warehouse/fields\.py"):
        fields.turn_columns(Odd)


def test_every_stored_field_of_an_episode_reads_back(tmp_path: Path) -> None:
    """The readers are derived too: an episode and its turns come back as recorded,
    RL tags and the output export included (they were not read back before)."""
    wh = Warehouse(tmp_path)
    ep, ts = make_episode("r1", "t", turns=3)
    ep = ep.model_copy(
        update={
            "training_run": "tr", "training_step": 7, "policy_version": "p3",
            "token_ids_status": "exact", "output_export": {"files": 2},
            "ended_at": datetime(2026, 1, 22, 12, 5, tzinfo=UTC), "termination": "submitted",
        }
    )  # fmt: skip
    with wh.writer(durability="flush") as w:
        record(w, ep, ts)
    with wh.query() as q:
        (row,) = q.arrow("SELECT * FROM episodes").to_pylist()
        turns = q.arrow("SELECT * FROM turns ORDER BY turn_index").to_pylist()
    back = episode_record(row)
    assert (back.training_run, back.training_step, back.policy_version) == ("tr", 7, "p3")
    assert back.output_export == {"files": 2} and back.token_ids_status == "exact"
    assert back.task_id == "t" and back.ended_at == ep.ended_at
    assert [turn_record(r) for r in turns] == sorted(ts, key=lambda t: t.turn_index)
