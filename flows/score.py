"""The score flow: rewards for a run's episodes, from the warehouse, re-runnable.

Scoring reads the recorded answers; it never re-runs an episode. Run it again with
another verifier (`--verifier rouge`) and the new scores are stored beside the old
ones under their own verifier name; readers pick the latest batch per verifier.
Infrastructure failures are not scored (they are not the model's answer).

Each score names the recording attempt it judged (`episode_write_id`). An episode
recorded again after scoring (a resumed run re-ran it) has a stale score: readers leave
it out (the `scores` view; `stale_scores` lists them) rather than show a verdict on an
answer that no longer exists, and running this flow again scores every current attempt.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows import artifacts
from flows.tasksets import resolve_taskset, task_index


class ScoreError(ValueError):
    pass


def _task_set_of(root: str, run_id: str, task_set: str | None) -> str:
    if task_set:
        return task_set
    import json

    from warehouse.layout import Layout
    from warehouse.runs import read_run

    row = read_run(Layout(root), run_id) or {}
    cfg = json.loads(row.get("config") or "{}")
    ts = cfg.get("task_set") or row.get("dataset")
    if not ts:
        raise ScoreError(
            f"run {run_id!r} does not record its task set: pass --task-set (the file or suite it ran)"
        )
    return str(ts)


def score_episodes(data: Any, tasks: dict[str, Any], verifier: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """Score rows for the warehouse, and the problems met (tasks missing from the set)."""
    from flows.verify import verify

    rows, problems = [], []
    for e in data.episodes:
        if e.termination is None or e.is_infra_failure:
            continue
        task = tasks.get(e.task_id)
        if task is None:
            problems.append(f"episode {e.episode_id}: task {e.task_id!r} is not in the task set")
            continue
        res = verify(task, e.answer, verifier)
        rows.append(
            {
                "run_id": data.run_id,
                "episode_id": e.episode_id,
                "verifier": verifier or res["verifier"] or task.verifier,
                "score": res["score"],
                "passed": res["score"] >= 1.0,
                "reason": res["reason"],
                "answer": e.answer,
                "ground_truth": task.ground_truth,
                "details": res.get("details") or {},
                "episode_write_id": data.attempts.get(e.episode_id),
            }
        )
    return rows, problems


@flow(name="sandflow-score", log_prints=False)
def score_flow(
    run_id: str, warehouse: str = "warehouse_data", task_set: str | None = None, verifier: str | None = None
) -> dict[str, Any]:
    """Score run `run_id` (verifier: the task's own unless named)."""
    from flows.store import load_run
    from warehouse.store import Warehouse

    data = load_run(warehouse, run_id, with_turns=False)
    ts = resolve_taskset(_task_set_of(warehouse, run_id, task_set))
    rows, problems = score_episodes(data, task_index(ts), verifier)
    path = Warehouse(warehouse).write_scores(rows)
    mean = sum(r["score"] for r in rows) / len(rows) if rows else None
    summary = {
        "run_id": run_id,
        "scored": len(rows),
        "mean_score": mean,
        "verifier": verifier or "task default",
        "problems": problems[:20],
        "skipped_files": data.skipped_files[:20],
        "file": str(path) if path else None,
    }
    artifacts.table(
        [{"episode_id": r["episode_id"], "score": r["score"], "reason": r["reason"]} for r in rows[:500]],
        artifacts.artifact_key("scores", run_id),
        f"Scores of run {run_id}",
    )
    return summary
