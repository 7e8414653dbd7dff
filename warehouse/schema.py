"""The warehouse's Arrow schemas: one place, one version number.

`turns` and `episodes` are derived from their column tables in warehouse/fields.py (each
record field declared once there, or derived from the record itself); `runs`, `scores`
and `usage` are rows tables declared here.

Why one module: the writer, the compactor, the query layer and the benchmark must agree
on every column. Rules that keep old files readable forever:

- Columns are only ever *added* (with a nullable type) and never renamed or retyped;
  readers union files *by column name* and the views add any column an old file lacks
  as a typed NULL, so a file written at version 1 still reads at version 5.
- Every file carries key-value metadata ``sandflow.table``,
  ``sandflow.schema_version`` and ``sandflow.columns``; a Parquet file without the table
  tag is foreign and is left out of the views (with a warning naming it). The column list
  lets the reader group files by shape from their footers alone, so it never needs
  DuckDB's slower ``union_by_name`` (each group is read as is and projected onto the
  current schema, missing columns as typed NULLs).

Nested data, and why it is stored the way it is:

- ``tool_calls`` and ``observations`` are ``list<struct>`` columns: SQL reaches them with
  ``unnest(observations)`` / ``o.timed_out`` without parsing JSON, and the common
  questions (slow tools, time-outs, capability usage) stay fast. A tool call's
  ``arguments`` is kept as the raw JSON text the model produced (it may be invalid JSON);
  DuckDB reads fields from it with ``arguments->>'command'``.
- Free-form dicts (``extra_messages``, ``prompt_messages``, ``config``, score
  ``details``) are JSON text: their shape varies by model and task, and a struct column
  would change type from file to file.
- Token ids are ``list<int32>`` and logprobs ``list<float64>``: exactly what the server
  returned, for RL.

``run_id`` is a column in every file *and* the hive partition directory
(``<table>/run_id=<id>/``), so a single file read with pyarrow is self-describing and
DuckDB prunes partitions on ``WHERE run_id = ...``.
"""

from __future__ import annotations

import re

import pyarrow as pa

from warehouse.fields import EPISODE_COLUMNS, TS, TURN_COLUMNS, schema_of

SCHEMA_VERSION = 1
TABLES = ("runs", "episodes", "turns", "scores", "usage", "data_items", "train_steps")
META_TABLE = b"sandflow.table"
META_VERSION = b"sandflow.schema_version"
META_COLUMNS = b"sandflow.columns"  # comma-separated column names: files group without a scan
# "1" on a turns file with prompt ids stored as deltas (only such files need the view's
# reconstruction; readers of the others pay nothing for it)
META_PROMPT_DELTAS = b"sandflow.prompt_deltas"

_TS = TS
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

RUNS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("started_at", _TS),
        pa.field("ended_at", _TS),
        pa.field("status", pa.string()),  # running | finished | failed | interrupted
        pa.field("model", pa.string()),
        pa.field("image", pa.string()),
        pa.field("dataset", pa.string()),
        pa.field("dataset_hash", pa.string()),
        pa.field("config", pa.string()),  # JSON, secrets removed
        pa.field("host", pa.string()),
        pa.field("sandflow_version", pa.string()),
        pa.field("notes", pa.string()),
        pa.field("written_at", _TS),
        # Lineage (NULL in older files): runs of one series, task set (dataset_hash) and
        # model are compared night to night (the run_series / nightly_diff views).
        pa.field("series", pa.string()),  # the deployment or --series name; NULL: ad hoc
        pa.field("image_id", pa.string()),  # the sandbox image's engine id (sha256:...)
    ]
)

# The record tables: derived from their column tables (warehouse/fields.py), where each
# field of a TurnRecord / EpisodeRecord is declared once (or derived from the record).
EPISODES = schema_of(EPISODE_COLUMNS)
TURNS = schema_of(TURN_COLUMNS)

SCORES = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("verifier", pa.string(), nullable=False),
        pa.field("score", pa.float64()),
        pa.field("passed", pa.bool_()),
        pa.field("reason", pa.string()),
        pa.field("answer", pa.string()),
        pa.field("ground_truth", pa.string()),
        pa.field("details", pa.string()),  # JSON
        pa.field("batch_id", pa.string(), nullable=False),
        pa.field("scored_at", _TS),
        # The episode's write_id (recording attempt) this score judged: a score of an
        # attempt since re-recorded is stale and left out of the `scores` view.
        pa.field("episode_write_id", pa.string()),
    ]
)

USAGE = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("turn_index", pa.int32(), nullable=False),
        pa.field("call_index", pa.int32()),  # which tool call of the turn (0-based)
        pa.field("capability", pa.string(), nullable=False),
        pa.field("tool", pa.string()),
        pa.field("detail", pa.string()),  # e.g. the matched command or rule
        pa.field("labeler", pa.string(), nullable=False),
        pa.field("batch_id", pa.string(), nullable=False),
        pa.field("labeled_at", _TS),
    ]
)

# RL data builds (datagen/, docs/data.md): one row per item a stage saw (a document, a
# question slot, a candidate task), kept or dropped with its reason, and the provenance the
# item carries by then. `run_id` is the build's id. One batch file per stage execution; the
# views read the newest batch of each (build, stage): data_funnel, data_dropped, task_provenance.
DATA_ITEMS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),  # the build id
        pa.field("stage", pa.string(), nullable=False),  # ingest | synth | clean | calibrate | export
        pa.field("stage_order", pa.int32(), nullable=False),
        pa.field("stage_key", pa.string()),  # hash of the stage's inputs and parameters
        pa.field("item_id", pa.string(), nullable=False),  # document source, slot id, task id
        pa.field("kept", pa.bool_(), nullable=False),
        pa.field("reason", pa.string()),  # why it was dropped (NULL when kept)
        pa.field("detail", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("doc_id", pa.string()),
        pa.field("piece_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("span_start", pa.int64()),
        pa.field("span_end", pa.int64()),
        pa.field("qa_type", pa.string()),
        pa.field("generator_model", pa.string()),
        pa.field("prompt_version", pa.string()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("calibration_run", pa.string()),
        pa.field("samples", pa.int32()),
        pa.field("passes", pa.int32()),
        pa.field("pass_rate", pa.float64()),
        pa.field("batch_id", pa.string(), nullable=False),
        pa.field("recorded_at", _TS),
    ]
)

# Training (rl/train.py, `sandflow train`, docs/train.md): one row per optimizer step, what
# the trainer logged and where the step's time went. `run_id` is the warehouse run of the
# step's rollouts (the env's run); the rollouts are the episodes tagged with the same
# training_run and step (`episode_ids` lists them). A step recorded again (a resumed run)
# is read from its newest row: the `training_steps` view.
TRAIN_STEPS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("training_run", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),  # 1-based: the optimizer step it ended
        pa.field("policy_version", pa.string()),  # the weights the rollouts were sampled from
        pa.field("loss", pa.float64()),
        pa.field("kl", pa.float64()),  # NULL with beta = 0 (no reference model)
        pa.field("grad_norm", pa.float64()),
        pa.field("learning_rate", pa.float64()),
        pa.field("reward_mean", pa.float64()),  # as the trainer saw it (dropped rollouts out)
        pa.field("reward_std", pa.float64()),
        pa.field("tokens", pa.int64()),  # prompt + completion tokens of the step's rollouts
        pa.field("rollouts", pa.int64()),
        pa.field("dropped", pa.int64()),  # infrastructure failures: no reward, no gradient
        pa.field("wall_s", pa.float64()),
        pa.field("generation_s", pa.float64()),  # the policy generating (tool calls excluded)
        pa.field("sandbox_s", pa.float64()),  # sandboxes from the pool + tool calls
        pa.field("reward_s", pa.float64()),  # answers read, episodes recorded, verifiers
        pa.field("optimizer_s", pa.float64()),  # log-prob passes, backward, optimizer step
        pa.field("env_share", pa.float64()),  # (sandbox_s + reward_s) / wall_s
        pa.field("episode_ids", pa.list_(pa.string())),
        pa.field("batch_id", pa.string(), nullable=False),
        pa.field("recorded_at", _TS),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "runs": RUNS,
    "episodes": EPISODES,
    "turns": TURNS,
    "scores": SCORES,
    "usage": USAGE,
    "data_items": DATA_ITEMS,
    "train_steps": TRAIN_STEPS,
}

# Columns a file must have to belong to a table (the rest may be missing in old files).
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id",),
    "episodes": ("run_id", "episode_id", "write_id"),
    "turns": ("run_id", "episode_id", "write_id", "turn_index"),
    "scores": ("run_id", "episode_id", "verifier", "batch_id"),
    "usage": ("run_id", "episode_id", "turn_index", "capability", "labeler", "batch_id"),
    "data_items": ("run_id", "stage", "item_id", "kept", "batch_id"),
    "train_steps": ("run_id", "training_run", "step", "batch_id"),
}


def schema_for(table: str) -> pa.Schema:
    """The current schema of `table`, tagged with the table name and schema version."""
    try:
        schema = SCHEMAS[table]
    except KeyError:
        raise ValueError(
            f"unknown warehouse table {table!r}; tables: {', '.join(TABLES)}"
        ) from None
    return schema.with_metadata(file_metadata(table, schema.names))


def file_metadata(table: str, columns: list[str]) -> dict[bytes, bytes]:
    """The key-value metadata every warehouse file carries."""
    return {
        META_TABLE: table.encode(),
        META_VERSION: str(SCHEMA_VERSION).encode(),
        META_COLUMNS: ",".join(columns).encode(),
    }


def empty_table(table: str) -> pa.Table:
    return schema_for(table).empty_table()


def check_run_id(run_id: str) -> str:
    """Run ids become directory names: keep them to a safe alphabet."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise ValueError(
            f"invalid run_id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "(starting with a letter or digit)"
        )
    return run_id
