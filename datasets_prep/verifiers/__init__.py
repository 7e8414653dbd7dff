"""Verifiers (rewards): pure functions (answer, ground_truth, task) -> VerifierResult.

The one entry point for everyone else:

    from datasets_prep.verifiers import score
    r = score(task, answer)            # verifier chosen by task.verifier / qa_type / domain
    r = score(task, answer, "rouge")   # or by name
    r.score, r.reason

Names: see `available()` or `sandflow tasks verifiers`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from datasets_prep.verifiers import choice, instruct, mathv, numeric, text  # noqa: F401  (register)
from datasets_prep.verifiers.base import (
    DESCRIPTIONS,
    GOLD_CHECKS,
    REGISTRY,
    VerifierError,
    VerifierResult,
)
from datasets_prep.verifiers.judge import JudgeEndpoint

if TYPE_CHECKING:
    from datasets_prep.task import Task

QA_TYPE_VERIFIERS: dict[str, str] = {
    "math": "math",
    "numeric": "numeric",
    "single_choice": "choice_single",
    "multi_choice": "choice_multi",
    "exact": "exact",
    "string": "exact",
    "open": "open",
    "open_ended": "open",
    "free-form": "open",
    "instruction": "instruction",
    "ifbench": "instruction",
}

_LETTERS = re.compile(r"^\s*[A-Z](\s*,\s*[A-Z])*\s*$")


def available() -> dict[str, str]:
    """Verifier name -> one-line description (plus `auto`)."""
    return {"auto": "chosen by the task's verifier field, qa_type, then domain", **DESCRIPTIONS}


def choose(task: Task) -> str:
    """The verifier `auto` picks for a task."""
    if task.verifier and task.verifier != "auto":
        return task.verifier
    qt = (task.qa_type or "").strip().lower()
    gt = task.ground_truth
    if qt in QA_TYPE_VERIFIERS:
        return QA_TYPE_VERIFIERS[qt]
    if "multiple choice" in qt or qt in ("mcq", "choice"):  # the peer's qa_type values
        return "choice_multi" if "," in str(gt) else "choice_single"
    domain = task.domain.lower()
    if domain.startswith("math"):
        return "math"
    if domain.startswith("instruct"):
        return "instruction"
    if domain.startswith("physics"):
        return "numeric" if isinstance(gt, dict | int | float) else "math"
    if domain.startswith(("chem", "biomed")) and isinstance(gt, str) and _LETTERS.match(gt):
        return "choice_multi" if "," in gt else "choice_single"
    if isinstance(gt, int | float) and not isinstance(gt, bool):
        return "numeric"
    if isinstance(gt, dict) and "value" in gt:  # {"value", "unit", "rel_tol"}: a quantity
        return "numeric"
    return "open"


def get(name: str) -> Any:
    try:
        return REGISTRY[name]
    except KeyError:
        raise VerifierError(f"unknown verifier {name!r}; known: auto, {', '.join(sorted(REGISTRY))}") from None


def check_ground_truth(task: Task, verifier: str | None = None) -> str:
    """Raise VerifierError when the verifier that would score `task` (by name, or the one
    `auto` picks) is unknown or cannot use its ground truth; return the verifier's name.

    Task validation calls this, so a ground truth no verifier can use (a nested dict, a
    letter outside the options, ...) is refused when the task set is prepared, not
    discovered as a silent 0 after the episodes ran. Scoring runs the same check first."""
    explicit = verifier not in (None, "", "auto")
    name = str(verifier) if explicit else choose(task)
    get(name)
    gold = GOLD_CHECKS.get(name)
    if gold is not None:
        try:
            gold(task.ground_truth, task)
        except VerifierError as e:
            how = "" if explicit or (task.verifier and task.verifier != "auto") else (
                f" (picked for qa_type {task.qa_type!r})" if task.qa_type else f" (picked for domain {task.domain!r})"
            )
            raise VerifierError(f"ground_truth: the {name!r} verifier{how} cannot use it: {e}") from None
    return name


def score(
    task: Task, answer: Any, verifier: str | None = None, *, judge: JudgeEndpoint | None = None
) -> VerifierResult:
    """Score one answer for one task. `verifier=None` or "auto" picks by the task.

    A malformed or empty answer scores 0 with a reason; an unusable ground truth
    or an unknown verifier raises VerifierError (the task's fault, not the model's).
    `judge`: the endpoint of the LLM judge, used only by verifier="judge"."""
    name = choose(task) if verifier in (None, "", "auto") else str(verifier)
    fn = get(name)
    if name == "judge":
        return fn(answer, task.ground_truth, task, endpoint=judge)
    return fn(answer, task.ground_truth, task)


__all__ = [
    "JudgeEndpoint",
    "VerifierResult",
    "VerifierError",
    "score",
    "check_ground_truth",
    "choose",
    "available",
    "get",
    "REGISTRY",
]
