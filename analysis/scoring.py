"""A run's recorded answers -> score rows for the warehouse, through datasets_prep's verifiers.

Infrastructure failures are not scored (they are not the model's answer). Each row names
the recording attempt it judged (`episode_write_id`), so a score of an episode recorded
again later reads as stale instead of judging an answer that no longer exists.
"""

from __future__ import annotations

from typing import Any

from datasets_prep.task import Task
from datasets_prep.verifiers import JudgeEndpoint, score
from warehouse.rundata import RunData


def score_episodes(
    data: RunData,
    tasks: dict[str, Task],
    verifier: str | None,
    *,
    judge: JudgeEndpoint | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Score rows (the warehouse's `scores` shape), and the problems met (tasks missing)."""
    rows, problems = [], []
    for e in data.episodes:
        if e.termination is None or e.is_infra_failure:
            continue
        task = tasks.get(e.task_id)
        if task is None:
            problems.append(f"episode {e.episode_id}: task {e.task_id!r} is not in the task set")
            continue
        res = score(task, e.answer, verifier, judge=judge)
        value = float(res.score)
        rows.append(
            {
                "run_id": data.run_id,
                "episode_id": e.episode_id,
                "verifier": verifier or res.verifier or task.verifier,
                "score": value,
                "passed": value >= 1.0,
                "reason": res.reason,
                "answer": e.answer,
                "ground_truth": task.ground_truth,
                "details": res.details or {},
                "episode_write_id": data.attempts.get(e.episode_id),
            }
        )
    return rows, problems
