"""Text answers: normalised exact match, ROUGE-L, and the paper's open-answer rule
(a math check first, then ROUGE-L against the reference)."""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from datasets_prep.verifiers.base import VerifierResult, register, result, text_like
from datasets_prep.verifiers.extract import final_answer

if TYPE_CHECKING:
    from datasets_prep.task import Task

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation + "“”‘’«»…—–"})


def normalize(text: str) -> str:
    """Lower case, NFKC, no punctuation, no articles, single spaces (SQuAD-style)."""
    t = unicodedata.normalize("NFKC", text).lower()
    t = t.replace("\\text{", " ").replace("\\boxed{", " ")
    t = t.translate(_PUNCT)
    t = _ARTICLES.sub(" ", t)
    return " ".join(t.split())


def _golds(ground_truth: Any) -> list[str]:
    return text_like(ground_truth, "text")


def _gold_text(ground_truth: Any, task: Task | None) -> None:
    _golds(ground_truth)


def _against_golds(
    answer: str, ground_truth: Any, judge: Callable[[str, list[str]], VerifierResult]
) -> VerifierResult:
    """exact and rouge alike: `judge`(answer text, references)."""
    return judge(answer, _golds(ground_truth))


@register("exact", "normalised string match (case, punctuation, articles ignored); a list means any of", gold=_gold_text)
def exact(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    return _against_golds(answer, ground_truth, _exact_match)


def _exact_match(text: str, golds: list[str]) -> VerifierResult:
    wanted = {normalize(g) for g in golds}
    for cand in (text, final_answer(text)):
        if normalize(cand) in wanted:
            return result(1, f"matches {golds[0]!r}" if len(golds) == 1 else "matches an accepted answer")
    shown = final_answer(text)[:60]
    return result(0, f"{shown!r} does not match {golds[0]!r}" + (f" (or {len(golds) - 1} more)" if len(golds) > 1 else ""))


@lru_cache(maxsize=1)
def _scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


@register("rouge", "ROUGE-L F1 against the reference text (stemmed)", gold=_gold_text)
def rouge(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    return _against_golds(answer, ground_truth, _rouge_l)


def _rouge_l(text: str, golds: list[str]) -> VerifierResult:
    best = max(_scorer().score(g, text)["rougeL"].fmeasure for g in golds)
    return result(best, f"ROUGE-L F1 {best:.3f}", rouge_l=best)


@register("open", "open answer as the paper scores it: math-verify first, then ROUGE-L", gold=_gold_text)
def open_answer(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    from datasets_prep.verifiers.mathv import math_equal

    golds = _golds(ground_truth)
    for g in golds:
        ok, why = math_equal(answer, g)
        if ok:
            return result(1, f"mathematically equal to the reference ({why})")
    r = rouge(answer, golds, task)
    return result(r.score, f"not a math match; {r.reason}", rouge_l=r.score)
