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

from analysis.scoring import score_episodes
from datasets_prep.verifiers import JudgeEndpoint
from flows import artifacts
from warehouse import DEFAULT_ROOT, Warehouse


class ScoreError(ValueError):
    pass


def tasks_of_run(root: str, run_id: str, task_set: str | None = None) -> Any:
    """The tasks to score or export run `run_id` with: `task_set` when the user names one;
    else the exact tasks the run recorded (warehouse.tasksets); else, for a run recorded
    before runs kept their tasks, its source loaded again -- refused when that no longer
    gives the task set the run names (the source changed since)."""
    import json

    from datasets_prep.prepare import load_taskset

    if task_set:
        return load_taskset(task_set)
    wh = Warehouse(root)
    stored = wh.run_tasks(run_id)
    if stored is not None:
        return stored
    row = wh.run_info(run_id) or {}
    cfg = json.loads(row.get("config") or "{}")
    source = cfg.get("task_set") or row.get("dataset")
    if not source:
        raise ScoreError(
            f"run {run_id!r} does not record its task set: pass --task-set (the file or suite it ran)"
        )
    ts = load_taskset(str(source))
    ran = row.get("dataset_hash")
    if ran and ts.content_hash != ran:
        raise ScoreError(
            f"run {run_id!r} ran task set {str(ran)[:12]}, but its source {source!r} now gives "
            f"{ts.short_hash} (changed since the run): pass --task-set with the file the run ran"
        )
    return ts


@flow(name="sandflow-score", log_prints=False)
def score_flow(
    run_id: str,
    warehouse: str = DEFAULT_ROOT,
    task_set: str | None = None,
    verifier: str | None = None,
    judge: JudgeEndpoint | None = None,
) -> dict[str, Any]:
    """Score run `run_id` (verifier: the task's own unless named; `judge`: the LLM judge's
    endpoint, handed in by the command, for verifier="judge"; its key is never stored)."""
    wh = Warehouse(warehouse)
    data = wh.load_run(run_id, with_turns=False)
    ts = tasks_of_run(warehouse, run_id, task_set)
    rows, problems = score_episodes(data, {t.id: t for t in ts.tasks}, verifier, judge=judge)
    path = wh.write_scores(rows)
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
