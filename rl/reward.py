"""The reward of an episode: its answer checked by the task's verifier (datasets_prep).

A wrong or missing answer is the model's doing and scores 0 with a reason. A ground truth
the verifier cannot use is the task's fault: `RewardError`, never a silent 0 (a trainer
must not learn from it). Verifiers are pure and safe in any thread (math-verify's
alarm-based timeouts are replaced by bounded inputs off the main thread).
"""

from __future__ import annotations

from dataclasses import dataclass

from datasets_prep.task import Task


class RewardError(ValueError):
    """The task's ground truth or verifier is unusable: not the model's answer's fault."""


@dataclass(frozen=True)
class Reward:
    score: float
    reason: str
    verifier: str


def reward_of(task: Task, answer: str | None, verifier: str | None = None) -> Reward:
    from datasets_prep.verifiers import VerifierError, score

    try:
        r = score(task, answer, verifier)
    except VerifierError as exc:
        raise RewardError(f"task {task.id!r}: {exc}") from None
    return Reward(score=float(r.score), reason=r.reason, verifier=r.verifier or str(verifier))



def check_scorable(task: Task, verifier: str | None = None) -> str:
    """RewardError unless the task's verifier can score it (datasets_prep.task.
    check_scorable: a ground truth, one its verifier can use): a task set that cannot
    reward is refused before any rollout (rl.verifiers_env, rl.openenv_server)."""
    from datasets_prep.task import check_scorable as check
    from datasets_prep.verifiers import VerifierError

    try:
        return check(task, verifier)
    except VerifierError as exc:
        raise RewardError(str(exc)) from None
