"""What every verifier returns, and the registry that names them.

A verifier is a pure function `(answer, ground_truth, task) -> VerifierResult`:
no I/O (the optional LLM judge is the one exception, and says so), no global
state, safe in any thread. A malformed *answer* is the model's doing and scores
0 with a reason; an unusable *ground truth* or verifier name is the task's or the
caller's doing and raises `VerifierError`, so it is never silently scored as 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from datasets_prep.task import Task


class VerifierResult(BaseModel):
    """A reward in [0, 1] and a short reason a person can read in a report."""

    score: float = Field(ge=0.0, le=1.0)
    reason: str
    verifier: str = ""
    details: dict[str, Any] = Field(default_factory=dict)

    @property
    def correct(self) -> bool:
        return self.score >= 1.0


class VerifierError(ValueError):
    """The ground truth or the verifier choice is unusable (not the answer's fault)."""


VerifierFn = Callable[..., VerifierResult]  # (answer, ground_truth, task, **inputs)
GoldCheck = Callable[[Any, "Task | None"], None]
REGISTRY: dict[str, VerifierFn] = {}
DESCRIPTIONS: dict[str, str] = {}
# name -> a cheap check that raises VerifierError for a ground truth the verifier cannot
# use. It runs before every scoring (so an unusable ground truth is never the answer's 0,
# even for an empty answer) and when a task is built (datasets_prep.task).
GOLD_CHECKS: dict[str, GoldCheck] = {}


def register(
    name: str, description: str, gold: GoldCheck | None = None
) -> Callable[[VerifierFn], VerifierFn]:
    def deco(fn: VerifierFn) -> VerifierFn:
        def wrapped(
            answer: Any, ground_truth: Any, task: Task | None = None, **inputs: Any
        ) -> VerifierResult:
            if gold is not None:
                gold(ground_truth, task)
            r = fn(answer, ground_truth, task, **inputs)  # inputs: e.g. the judge's endpoint
            if not r.verifier:
                r.verifier = name
            return r

        wrapped.__name__ = fn.__name__
        wrapped.__doc__ = fn.__doc__
        REGISTRY[name] = wrapped
        DESCRIPTIONS[name] = description
        if gold is not None:
            GOLD_CHECKS[name] = gold
        return wrapped

    return deco


def result(score: float, reason: str, **details: Any) -> VerifierResult:
    return VerifierResult(score=max(0.0, min(1.0, float(score))), reason=reason, details=details)


def as_text(answer: Any) -> str | None:
    """The answer as text, or None when there is nothing to check."""
    if answer is None:
        return None
    if isinstance(answer, bytes):
        answer = answer.decode("utf-8", "replace")
    text = str(answer)
    return text if text.strip() else None


def describe(value: Any, n: int = 80) -> str:
    """A short description of a value for an error: its type and the start of its repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:n]}{'...' if len(text) > n else ''}"


def text_like(ground_truth: Any, verifier: str) -> list[str]:
    """The accepted answers of a text-like ground truth: text, a number, or a flat list of
    those. Anything else (a dict, a nested list, an object) raises VerifierError."""
    items = list(ground_truth) if isinstance(ground_truth, list | tuple) else [ground_truth]
    for g in items:
        if g is not None and not isinstance(g, str | int | float):
            raise VerifierError(
                f"the {verifier!r} verifier needs a ground truth of text, a number, or a list of "
                f"those; got {describe(ground_truth)}"
            )
    out = [str(g) for g in items if g is not None and str(g).strip()]
    if not out:
        raise VerifierError(f"{verifier} ground truth is empty: {ground_truth!r}")
    return out
