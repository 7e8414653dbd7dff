"""Multiple choice: one option by exact match, several options by F1 (as the paper)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from datasets_prep.verifiers.base import (
    VerifierError,
    VerifierResult,
    register,
    result,
)
from datasets_prep.verifiers.extract import last_boxed

if TYPE_CHECKING:
    from datasets_prep.task import Task

_LETTER_LIST = re.compile(r"^\(?[A-Z]\)?(?:\s*(?:,|;|/|&|\band\b|\s)\s*\(?[A-Z]\)?)*\.?$", re.IGNORECASE)
_PATTERNS = (
    re.compile(r'"answer"\s*:\s*"([A-Z](?:\s*,\s*[A-Z])*)"', re.IGNORECASE),
    re.compile(r"(?:final\s+)?answer\s*(?:is|[:：])\s*\(?([A-Z](?:\s*(?:,|and)\s*[A-Z])*)\)?(?![A-Za-z])", re.IGNORECASE),
    re.compile(r"(?:options?|choices?)\s+(?:is|are)\s*\(?([A-Z](?:\s*(?:,|and)\s*[A-Z])*)\)?(?![A-Za-z])", re.IGNORECASE),
)


_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_OPTION_LINE = re.compile(r"^\(?([A-Z])[.):]\)?\s+\S")


def _valid_letters(task: Task | None) -> str:
    n = len((task.metadata.get("choices") if task else None) or []) or 26
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def letters_in(text: str, valid: str) -> set[str] | None:
    """The option letters an answer gives, or None when none can be read."""
    candidates = []
    boxed = last_boxed(text)
    if boxed is not None:
        candidates.append(re.sub(r"\\text\{([^}]*)\}", r"\1", boxed))
    stripped = text.replace("*", "").strip()  # markdown bold around letters
    candidates.append(stripped)
    lines = [ln.strip() for ln in stripped.splitlines() if ln.strip()]
    if lines:
        candidates.append(lines[-1])
    for c in candidates:
        if _LETTER_LIST.match(c.strip()):
            found = {x.upper() for x in re.findall(r"\b[A-Za-z]\b", c.replace("and", " "))}
            if found and found <= set(valid):
                return found
    for pat in _PATTERNS:
        matches = list(pat.finditer(stripped))
        if matches:
            found = {x.upper() for x in re.findall(r"[A-Za-z]", matches[-1].group(1).replace("and", ""))}
            if found and found <= set(valid):
                return found
    # An option quoted with its text, e.g. "B. urea (CH4N2O)" or "(C) sodium chloride".
    for c in (lines[-1] if lines else "", stripped):
        m = _OPTION_LINE.match(c)
        if m and m.group(1).upper() in valid:
            return {m.group(1).upper()}
    return None


def gold_letters(ground_truth: Any) -> set[str]:
    if isinstance(ground_truth, list | tuple | set):
        items = list(ground_truth)
    elif isinstance(ground_truth, str):
        items = re.split(r"[,;\s]+", ground_truth)
    else:
        items = [ground_truth]
    if any(not isinstance(x, str) for x in items):
        raise VerifierError.wrong("multiple-choice ground truth must be option letters", ground_truth)
    gold = {x.strip().upper() for x in items if x.strip()}
    if not gold or any(len(g) != 1 or g not in _ALPHABET for g in gold):
        raise VerifierError.wrong("multiple-choice ground truth must be option letters", ground_truth)
    return gold


def _gold_choice(ground_truth: Any, task: Task | None, *, single: bool) -> None:
    gold = gold_letters(ground_truth)
    valid = _valid_letters(task)
    outside = sorted(gold - set(valid))
    if outside:
        raise VerifierError(
            f"ground truth letter(s) {','.join(outside)} are not among the task's {len(valid)} options"
        )
    if single and len(gold) > 1:
        raise VerifierError(
            f"single-choice ground truth names {len(gold)} options ({','.join(sorted(gold))}): "
            "use qa_type multi_choice"
        )


def _gold_single(ground_truth: Any, task: Task | None) -> None:
    _gold_choice(ground_truth, task, single=True)


def _gold_multi(ground_truth: Any, task: Task | None) -> None:
    _gold_choice(ground_truth, task, single=False)


def _choice(
    answer: str,
    ground_truth: Any,
    task: Task | None,
    *,
    none_found: str,
    judge: Callable[[set[str], set[str]], VerifierResult],
) -> VerifierResult:
    """Both choice verifiers: the gold and the chosen letters read alike, then `judge`
    (gold, chosen) scores them; an answer naming no readable option letter scores 0
    (`none_found` says so)."""
    gold = gold_letters(ground_truth)
    got = letters_in(answer, _valid_letters(task))
    if got is None:
        return result(0, none_found)
    return judge(gold, got)


def _exactly_one(gold: set[str], got: set[str]) -> VerifierResult:
    if len(got) > 1:
        return result(0, f"gave {len(got)} options ({','.join(sorted(got))}) where one is expected")
    ok = got == gold
    return result(1 if ok else 0, f"chose {next(iter(got))}, expected {','.join(sorted(gold))}", chosen=sorted(got))


def _f1(gold: set[str], got: set[str]) -> VerifierResult:
    tp = len(got & gold)
    if tp == 0:
        return result(0, f"chose {','.join(sorted(got))}, expected {','.join(sorted(gold))}: none right")
    p, r = tp / len(got), tp / len(gold)
    f1 = 2 * p * r / (p + r)
    return result(
        f1,
        f"chose {','.join(sorted(got))}, expected {','.join(sorted(gold))}: F1 {f1:.2f}",
        chosen=sorted(got),
        precision=p,
        recall=r,
    )


@register("choice_single", "one option letter, exact match", gold=_gold_single, any_of=False)
def choice_single(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    return _choice(answer, ground_truth, task, none_found="no option letter found in the answer", judge=_exactly_one)


@register("choice_multi", "a set of option letters, F1 against the gold set", gold=_gold_multi, any_of=False)
def choice_multi(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    return _choice(answer, ground_truth, task, none_found="no option letters found in the answer", judge=_f1)
