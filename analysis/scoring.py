"""A run's recorded answers -> score rows for the warehouse, through the one reward
(analysis.trajectory.reward: the task's verifier, datasets_prep.verifiers).

Infrastructure failures are not scored (they are not the model's answer). Each row names
the recording attempt it judged (`episode_write_id`), so a score of an episode recorded
again later reads as stale instead of judging an answer that no longer exists.
"""

from __future__ import annotations

from typing import Any

from analysis.trajectory import reward, score_row
from datasets_prep.task import Task
from datasets_prep.verifiers import JudgeEndpoint
from warehouse.rundata import RunData


def score_episodes(
    data: RunData,
    tasks: dict[str, Task],
    verifier: str | None,
    *,
    judge: JudgeEndpoint | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Score rows (the warehouse's `scores` shape, analysis.trajectory.score_row), and the
    problems met (tasks missing). An unusable ground truth raises RewardError (a
    VerifierError) naming the task."""
    rows, problems = [], []
    for e in data.episodes:
        if e.termination is None or e.is_infra_failure:
            continue
        task = tasks.get(e.task_id)
        if task is None:
            problems.append(f"episode {e.episode_id}: task {e.task_id!r} is not in the task set")
            continue
        r = reward(task, e.answer, verifier, judge=judge)
        rows.append(score_row(e, task, r, write_id=data.attempts.get(e.episode_id)))
    return rows, problems
