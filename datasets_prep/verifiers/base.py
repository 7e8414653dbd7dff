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

    @classmethod
    def wrong(cls, needs: str, value: Any) -> VerifierError:
        """The refusal of a value that is not what `needs` says, worded the same way by
        every verifier: "<needs>, got <its type and the start of its repr>"."""
        return cls(f"{needs}, got {describe(value)}")


VerifierFn = Callable[..., VerifierResult]  # (answer, ground_truth, task, **inputs)
GoldCheck = Callable[[Any, "Task | None"], None]
REGISTRY: dict[str, VerifierFn] = {}
DESCRIPTIONS: dict[str, str] = {}
# name -> a cheap check that raises VerifierError for a ground truth the verifier cannot
# use. It runs before every scoring (so an unusable ground truth is never the answer's 0,
# even for an empty answer) and when a task is built (datasets_prep.task).
GOLD_CHECKS: dict[str, GoldCheck] = {}


def accepted_answers(ground_truth: Any, verifier: str) -> list[Any]:
    """THE rule for a list ground truth: "any of these answers". A list (or tuple) is its
    items, each an accepted answer on its own; anything else is one accepted answer. A
    nested list is refused (which item is meant?), and so is an empty list."""
    if not isinstance(ground_truth, list | tuple):
        return [ground_truth]
    items = [g for g in ground_truth if not (g is None or (isinstance(g, str) and not g.strip()))]
    if not items:
        raise VerifierError(f"the {verifier!r} verifier got an empty list of accepted answers: {ground_truth!r}")
    for g in items:
        if isinstance(g, list | tuple):
            raise VerifierError.wrong(f"the {verifier!r} verifier needs a flat list of accepted answers", ground_truth)
    return items


def register(
    name: str,
    description: str,
    gold: GoldCheck | None = None,
    *,
    any_of: bool = True,
    text: bool = True,
) -> Callable[[VerifierFn], VerifierFn]:
    """Register a verifier. `any_of` (the default): a list ground truth means "any of these
    answers" -- the verifier sees one accepted answer at a time and the best score wins, so
    every such verifier applies the same rule. `any_of=False` for the verifiers whose
    ground truth is itself a structure (choice letters, an IFBench spec, a judge's
    reference); they read a list their own documented way.

    `text` (the default): the verifier is handed the answer as text, and an empty answer
    scores 0 here, once for all (after the ground truth's check: an unusable ground truth
    is the task's error even then). `text=False` hands the answer as it came (the judge
    checks its endpoint before it looks at the answer)."""

    def check(ground_truth: Any, task: Task | None) -> None:
        if gold is None:
            return
        for g in accepted_answers(ground_truth, name) if any_of else [ground_truth]:
            gold(g, task)

    def deco(fn: VerifierFn) -> VerifierFn:
        def wrapped(
            answer: Any, ground_truth: Any, task: Task | None = None, **inputs: Any
        ) -> VerifierResult:
            check(ground_truth, task)
            if text:
                answer = as_text(answer)
                if answer is None:
                    return VerifierResult(score=0.0, reason="empty answer", verifier=name)
            golds = accepted_answers(ground_truth, name) if any_of else [ground_truth]
            best: VerifierResult | None = None
            for i, g in enumerate(golds):
                r = fn(answer, g, task, **inputs)  # inputs: e.g. the judge's endpoint
                if len(golds) > 1:
                    r.reason = f"accepted answer {i + 1} of {len(golds)}: {r.reason}"
                if best is None or r.score > best.score:
                    best = r
                if r.score >= 1.0:
                    break
            assert best is not None  # accepted_answers never returns an empty list
            if len(golds) > 1 and best.score < 1.0:
                best.reason = f"best of {len(golds)} accepted answers; {best.reason}"
            if not best.verifier:
                best.verifier = name
            return best

        wrapped.__name__ = fn.__name__
        wrapped.__doc__ = fn.__doc__
        REGISTRY[name] = wrapped
        DESCRIPTIONS[name] = description
        if gold is not None:
            GOLD_CHECKS[name] = check
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
            raise VerifierError.wrong(
                f"the {verifier!r} verifier needs a ground truth of text, a number, or a list of those",
                ground_truth,
            )
    out = [str(g) for g in items if g is not None and str(g).strip()]
    if not out:
        raise VerifierError(f"{verifier} ground truth is empty: {ground_truth!r}")
    return out
