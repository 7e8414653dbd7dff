"""The warehouse: every turn in Parquet, queried with DuckDB, nothing lost, nothing twice.

API (everything below is importable from ``warehouse``)::

    from warehouse import Warehouse
    wh = Warehouse(root)       # the application resolves root (sandflow.config); default DEFAULT_ROOT

    # A run
    wh.write_run(run_id, model=..., image=..., dataset=..., dataset_hash=...,
                 config=settings.public_dict())   # secrets are scrubbed anyway
    wh.finish_run(run_id, status="finished")  # running | finished | failed | interrupted
    wh.keep_tasks(run_id, tasks)   # the exact tasks it runs (warehouse.tasksets); every entry
    wh.run_tasks(run_id) -> TaskSet | None     # point does, scoring and exports read them
    wh.unlike_tasks(run_a, run_b) -> str | None  # why two runs cannot be paired task by task

    # Episodes (the agent loop): EpisodeWriter implements tasks.records.Recorder
    rec = wh.writer()        # thread-safe; durability "turn" (default: written at once, fsynced
                             # in the background by group commit; an OS crash takes at most
                             # the last 4 records of an open episode), "sync", "flush"
    rec.start_episode(ep); rec.record_turn(turn); ...; rec.finish_episode(ep)
    rec.close()                                # unfinished episodes stay as orphans

    # Reading one run back as records (what analysis/ works on)
    wh.load_run(run_id, verifier=None, with_turns=True) -> RunData(episodes, turns, scores)

    # Resume
    wh.done_keys(run_id)        -> {(task_id, mode, sample_index)}   infra failures not done
    wh.done_episode_ids(run_id) -> {episode_id}
    wh.orphans(run_id)          -> [Orphan]       journals whose writer died
    wh.recover(run_id)          -> commits them as termination='interrupted'
    wh.recover(run_id, action="discard")

    # Scores and usage labels (the flows' score / usage steps); one batch file per call,
    # the newest batch per (episode, verifier) / (episode, labeler) wins in the views
    wh.write_scores([ScoreRow(run_id=, episode_id=, verifier=, score=, passed=, reason=,
                              answer=, ground_truth=, details={},
                              episode_write_id=)] or dicts)   # the attempt judged
    # a score of an attempt since re-recorded is stale: left out of `scores`, in `stale_scores`
    wh.write_usage([UsageRow(run_id=, episode_id=, turn_index=, call_index=, capability=,
                             tool=, detail=, labeler="rules")] or dicts)
    # capability: computation | file_management | external_resource | none

    # Reading back (Arrow tables; `where` is a SQL filter on the view)
    wh.episodes(run_id), wh.turns(run_id, where="turn_index < 3"), wh.scores(), wh.usage()
    with wh.query(run_id=None) as q:           # in-memory DuckDB with the views
        q.sql("SELECT * FROM accuracy")        # -> duckdb relation (.arrow(), .df(), ...)
        q.arrow("SELECT ...")                  # -> pyarrow.Table
        q.snapshot.bad                         # files left out, with reasons

    # Maintenance
    wh.compact(run_id)                         # one file per table, atomic, idempotent

    # Exports for other tools (not warehouse tables): rows in a schema, written atomically
    write_export(rows, schema, path)           # the rollouts flow's RL files

Views: every one, with its SQL and help, is in warehouse/views.py (the session that builds
them: warehouse.query). User guide: docs/warehouse.md.
Layout and file-level guarantees: see warehouse.layout; schemas: warehouse.schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from datasets_prep.lazy import lazy_exports

# Where a warehouse lives unless told otherwise: THE one place this default is written.
DEFAULT_ROOT = "warehouse_data"

# Lazy exports: `sandflow --help` imports sandflow.commands.sql (and this package), which
# must not pull in DuckDB.
_EXPORTS = {
    "CompactionResult": "warehouse.compact",
    "CAPABILITIES": "warehouse.labels",
    "ScoreRow": "warehouse.labels",
    "UsageRow": "warehouse.labels",
    "WarehouseError": "warehouse.query",
    "WarehouseNotFound": "warehouse.query",
    "WarehouseQuery": "warehouse.query",
    "WarehouseQueryError": "warehouse.query",
    "connect": "warehouse.query",
    "RunNotFound": "warehouse.query",
    "Orphan": "warehouse.recovery",
    "RunLocked": "warehouse.runlock",
    "RunData": "warehouse.rundata",
    "Score": "warehouse.rundata",
    "SCHEMA_VERSION": "warehouse.schema",
    "TABLES": "warehouse.schema",
    "schema_for": "warehouse.schema",
    "Warehouse": "warehouse.store",
    "RunTasksError": "warehouse.tasksets",
    "EpisodeWriter": "warehouse.writer",
    "write_export": "warehouse.exports",
    "RecordError": "warehouse.commit",
}

if TYPE_CHECKING:
    from warehouse.commit import RecordError
    from warehouse.compact import CompactionResult
    from warehouse.exports import write_export
    from warehouse.labels import CAPABILITIES, ScoreRow, UsageRow
    from warehouse.query import (
        RunNotFound,
        WarehouseError,
        WarehouseNotFound,
        WarehouseQuery,
        WarehouseQueryError,
        connect,
    )
    from warehouse.recovery import Orphan
    from warehouse.rundata import RunData, Score
    from warehouse.runlock import RunLocked
    from warehouse.schema import SCHEMA_VERSION, TABLES, schema_for
    from warehouse.store import Warehouse
    from warehouse.tasksets import RunTasksError
    from warehouse.writer import EpisodeWriter


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "CAPABILITIES",
    "DEFAULT_ROOT",
    "CompactionResult",
    "EpisodeWriter",
    "Orphan",
    "RecordError",
    "RunData",
    "RunLocked",
    "RunNotFound",
    "RunTasksError",
    "Score",
    "SCHEMA_VERSION",
    "ScoreRow",
    "TABLES",
    "UsageRow",
    "Warehouse",
    "WarehouseError",
    "WarehouseNotFound",
    "WarehouseQuery",
    "WarehouseQueryError",
    "connect",
    "schema_for",
    "write_export",
]
