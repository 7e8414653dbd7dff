"""Math answers checked with math-verify (sympy equivalence, not string equality).

math-verify guards parsing with signal.alarm, which works only in the main thread.
Here: in the main thread its timeouts stay on; in any other thread (Prefect task
runners, thread pools) they are switched off and the inputs are bounded instead
(answers cut to their final expression, at most MAX_EXPR_CHARS), which keeps
sympy's work small. So `score()` is safe to call from any thread.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from datasets_prep.verifiers.base import (
    VerifierError,
    VerifierResult,
    register,
    result,
    text_like,
)
from datasets_prep.verifiers.extract import final_answer, last_boxed

if TYPE_CHECKING:
    from datasets_prep.task import Task

MAX_EXPR_CHARS = 400
TIMEOUT_S = 5

logging.getLogger("math_verify").setLevel(logging.ERROR)


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_latex(s: str) -> str:
    s = s.strip()
    if "\\boxed" in s or s.startswith("$"):
        return s
    return "\\boxed{" + s + "}"


def _parse(text: str, *, gold: bool) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig()] if gold else [ExprExtractionConfig(), LatexExtractionConfig()]
    if gold:
        configs.append(ExprExtractionConfig())
    return parse(text, extraction_config=configs, parsing_timeout=_timeout())


def math_equal(answer: str, ground_truth: Any) -> tuple[bool, str]:
    """(equal?, short reason). The answer's final expression (last \\boxed{}, or the
    last line) is compared with the ground truth."""
    from math_verify import verify

    gold_text = str(ground_truth).strip()
    if not gold_text:
        raise VerifierError("math ground truth is empty")
    pred = last_boxed(answer)
    if pred is None:
        pred = final_answer(answer)
    pred = pred[:MAX_EXPR_CHARS]
    gold = _parse(_as_latex(gold_text[:MAX_EXPR_CHARS]), gold=True)
    if not gold:
        raise VerifierError(f"math ground truth cannot be parsed: {gold_text[:80]!r}")
    target = _parse(_as_latex(pred), gold=False)
    if not target:
        return False, f"could not read a math expression in {pred[:60]!r}"
    ok = bool(verify(gold, target, timeout_seconds=_timeout()))
    return ok, f"{pred[:40]!r} {'=' if ok else '!='} {gold_text[:40]!r}"


def _gold_math(ground_truth: Any, task: Task | None) -> None:
    """Text or a number (a flat list is read as its text); parsing waits for scoring."""
    text_like(ground_truth, "math")


@register("math", "mathematical equivalence with math-verify (last \\boxed{} or last line)", gold=_gold_math)
def math(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    ok, why = math_equal(answer, ground_truth)
    return result(1 if ok else 0, why)
