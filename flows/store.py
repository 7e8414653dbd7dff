"""The flows' window on the warehouse: what is done, and one run's records.

A thin adapter over `warehouse.Warehouse`'s query layer: every read goes through the
warehouse's views (one DuckDB session, one consistent snapshot), so resume, scoring,
usage, tokens, rollouts and the report get the warehouse's guarantees for free:

- the latest recording attempt of an episode wins, and its turns are that attempt's,
  across per-episode files and compacted files alike;
- a bad file (truncated, foreign, corrupt) is left out with a warning naming it, and the
  rest of the run stays readable (`RunData.skipped_files` lists what was left out);
- scores are the newest batch per (episode, verifier), and a score of an attempt that
  has since been re-recorded is stale: the `scores` view leaves it out (`stale_scores`
  lists it), so a re-recorded episode reads as unscored until the score flow runs again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flows.rundata import RunData, Score
from tasks.records import (
    INFRA_TERMINATIONS,
    EgressRequest,
    EpisodeRecord,
    Observation,
    ToolCall,
    TurnRecord,
    Usage,
)

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The warehouse does not hold what was asked for (the message says what to do)."""


def _layout(root: Path | str) -> Any:
    from warehouse.layout import Layout

    return Layout(root)


def _session(root: Path | str, run_id: str, tables: tuple[str, ...]) -> Any:
    """A query session on one run's files; user-facing errors become StoreError."""
    from warehouse.query import WarehouseError, WarehouseQuery

    try:
        return WarehouseQuery(root, run_id=run_id, tables=tables)
    except WarehouseError as exc:
        raise StoreError(str(exc)) from None
    except ValueError as exc:  # an invalid run id (it names it)
        raise StoreError(str(exc)) from None


def _rows(q: Any, sql: str) -> list[dict[str, Any]]:
    from warehouse.query import WarehouseError

    try:
        table = q.arrow(sql)
    except WarehouseError as exc:
        raise StoreError(f"reading run {q.run_id!r} failed: {exc}") from None
    out: list[dict[str, Any]] = []
    for batch in table.to_batches():  # batch by batch: no second full copy of the run
        out.extend(batch.to_pylist())
    return out


def _skipped(q: Any) -> list[str]:
    return [str(b) for b in q.snapshot.bad]


def episode_rows(root: Path | str, run_id: str) -> dict[str, dict[str, Any]]:
    """episode_id -> the row of its current (latest) recording attempt."""
    if not Path(root).is_dir():
        return {}
    with _session(root, run_id, ("episodes",)) as q:
        return {r["episode_id"]: r for r in _rows(q, "SELECT * FROM episodes")}


def done_keys(root: Path | str, run_id: str) -> set[str]:
    """Episode keys of `run_id` that finished with the model's own result.

    Infrastructure failures and interrupted episodes are NOT done: resume re-runs them.
    """
    if not Path(root).is_dir():
        return set()
    with _session(root, run_id, ("episodes",)) as q:
        rows = q.rows("SELECT episode_id, termination FROM episodes")
    return {eid for eid, term in rows if term and term not in INFRA_TERMINATIONS}


def run_ids(root: Path | str) -> list[str]:
    return list(_layout(root).run_ids("episodes"))


def _loads(text: str | None, default: Any) -> Any:
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


def _episode(r: dict[str, Any]) -> EpisodeRecord:
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


def _turn(r: dict[str, Any]) -> TurnRecord:
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


def score_rows(root: Path | str, run_id: str) -> list[dict[str, Any]]:
    """The run's current scores: newest batch per (episode, verifier), stale ones left out."""
    if not Path(root).is_dir():
        return []
    with _session(root, run_id, ("episodes", "scores")) as q:
        return _rows(q, "SELECT * FROM scores")


def latest_scores(rows: list[dict[str, Any]], verifier: str | None = None) -> dict[str, Score]:
    """episode_id -> Score from the latest batch (of `verifier`, when given)."""
    out: dict[str, tuple[str, Score]] = {}
    for r in rows:
        if verifier and r["verifier"] != verifier and not str(r["verifier"]).startswith(verifier + ":"):
            continue
        if r["score"] is None:
            continue
        key = r["episode_id"]
        if key not in out or str(r["batch_id"]) > out[key][0]:
            out[key] = (
                str(r["batch_id"]),
                Score(key, float(r["score"]), str(r["verifier"]), r["passed"], r["reason"]),
            )
    return {k: v for k, (_b, v) in out.items()}


def load_run(root: Path | str, run_id: str, *, verifier: str | None = None, with_turns: bool = True) -> RunData:
    """One run's latest episodes, their turns, and their current scores (one snapshot)."""
    if not Path(root).exists():
        raise StoreError(f"warehouse root {root} does not exist (set --warehouse or SANDFLOW_WAREHOUSE)")
    tables = ("episodes", "turns", "scores") if with_turns else ("episodes", "scores")
    with _session(root, run_id, tables) as q:
        eps = _rows(q, "SELECT * FROM episodes")
        if not eps:
            known = ", ".join(run_ids(root)[-5:]) or "none"
            raise StoreError(f"run {run_id!r} has no episodes in warehouse {root} (recent runs: {known})")
        data = RunData(
            run_id=run_id,
            episodes=[_episode(r) for r in eps],
            attempts={r["episode_id"]: r["write_id"] for r in eps},
            skipped_files=_skipped(q),
        )
        data.episodes.sort(key=lambda e: (e.domain, e.task_id, e.mode, e.sample_index))
        if with_turns:
            for r in _rows(q, "SELECT * FROM turns ORDER BY episode_id, turn_index"):
                data.turns.setdefault(r["episode_id"], []).append(_turn(r))
        data.scores = latest_scores(_rows(q, "SELECT * FROM scores"), verifier)
    if data.skipped_files:
        log.warning(
            "run %s: %d bad file(s) left out: %s",
            run_id,
            len(data.skipped_files),
            "; ".join(data.skipped_files[:5]),
        )
    return data
