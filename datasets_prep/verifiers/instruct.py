"""Instruction following: IFBench's checkers (from if-verifiable), loose and strict.

The ground truth is {"instruction_id_list": [...], "kwargs": [...]} (IFBench's
own fields; JSON text is accepted too, as the peer stores it). The score is 1
when every checkable instruction is followed (the paper's prompt-level metric);
the fraction is in `details["partial"]`. Checkers that need NLTK data this
machine cannot have offline (stopwords, a POS tagger) are reported as
unsupported instead of crashing; the built-in suite leaves such prompts out.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from datasets_prep.verifiers.base import VerifierError, VerifierResult, register, result

if TYPE_CHECKING:
    from datasets_prep.task import Task

# instruction id -> what it needs that is not available offline
UNSUPPORTED: dict[str, str] = {
    "ratio:stop_words": "NLTK stopwords corpus (not available offline)",
    "words:start_verb": "NLTK part-of-speech tagger (not available offline)",
}
_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def registry() -> dict[str, Any]:
    """IFBench's instruction classes, with NLTK made offline-safe first."""
    from datasets_prep.nltk_setup import disable_downloads, ensure_punkt_tab

    with _LOCK:
        ensure_punkt_tab()
        disable_downloads()
        from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT

    return dict(INSTRUCTION_DICT)


def parse_spec(ground_truth: Any, task: Task | None) -> tuple[list[str], list[dict[str, Any]], str]:
    gt = ground_truth
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError:
            raise VerifierError("instruction ground truth is text but not JSON") from None
    if not isinstance(gt, dict) or "instruction_id_list" not in gt:
        raise VerifierError.wrong(
            "instruction ground truth must be {'instruction_id_list': [...], 'kwargs': [...]}", gt
        )
    raw_ids, raw_kwargs = gt["instruction_id_list"], gt.get("kwargs")
    if not isinstance(raw_ids, list | tuple) or not raw_ids or not all(isinstance(i, str) and i for i in raw_ids):
        raise VerifierError.wrong("instruction_id_list must be a non-empty list of ids", raw_ids)
    ids = list(raw_ids)
    if raw_kwargs is not None and not isinstance(raw_kwargs, list | tuple):
        raise VerifierError.wrong("instruction kwargs must be a list of objects", raw_kwargs)
    kwargs = list(raw_kwargs or [{} for _ in ids])
    if len(kwargs) != len(ids):
        raise VerifierError(f"instruction ground truth has {len(ids)} ids but {len(kwargs)} kwargs")
    if not all(k is None or isinstance(k, dict) for k in kwargs):
        raise VerifierError.wrong("instruction kwargs must be objects (or null)", kwargs)
    prompt = str(gt.get("prompt") or (task.problem_statement if task else ""))
    return ids, kwargs, prompt


def _gold_spec(ground_truth: Any, task: Task | None) -> None:
    parse_spec(ground_truth, task)


def _loose_variants(response: str) -> list[str]:
    from if_verifiable.common import get_loose_transformations

    return list(get_loose_transformations(response))


def check(response: str, ids: list[str], kwargs: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """Per instruction: strict and loose pass, or the reason it cannot be checked."""
    reg = registry()
    variants = _loose_variants(response)
    out: list[dict[str, Any]] = []
    for iid, kw in zip(ids, kwargs, strict=True):
        if iid in UNSUPPORTED or iid not in reg:
            out.append({"id": iid, "unsupported": UNSUPPORTED.get(iid, "unknown instruction id")})
            continue
        checker = reg[iid](iid)
        checker.build_description(**{k: v for k, v in (kw or {}).items() if v is not None})
        args = checker.get_instruction_args()
        if args and "prompt" in args:
            checker.build_description(prompt=prompt)
        try:
            strict = bool(response.strip() and checker.check_following(response))
            loose = strict or any(v.strip() and checker.check_following(v) for v in variants)
        except LookupError as e:  # an NLTK resource that is not here
            out.append({"id": iid, "unsupported": f"needs NLTK data: {str(e).splitlines()[0][:80]}"})
            continue
        out.append({"id": iid, "strict": strict, "loose": loose})
    return out


def _score(answer: str, ground_truth: Any, task: Task | None, mode: str) -> VerifierResult:
    ids, kwargs, prompt = parse_spec(ground_truth, task)
    if "</think>" in answer:
        answer = answer.split("</think>", 1)[1].strip()
    checks = check(answer, ids, kwargs, prompt)
    checked = [c for c in checks if "unsupported" not in c]
    unsupported = [c for c in checks if "unsupported" in c]
    if not checked:
        raise VerifierError(
            "no instruction can be checked here: "
            + "; ".join(f"{c['id']}: {c['unsupported']}" for c in unsupported)
        )
    passed = [c for c in checked if c[mode]]
    partial = len(passed) / len(checked)
    failed = [c["id"] for c in checked if not c[mode]]
    reason = f"{len(passed)}/{len(checked)} instructions followed ({mode})"
    if failed:
        reason += f"; failed: {', '.join(failed[:4])}"
    if unsupported:
        reason += f"; {len(unsupported)} not checkable offline: {', '.join(c['id'] for c in unsupported)}"
    return result(1 if len(passed) == len(checked) else 0, reason, partial=partial, checks=checks)


@register("instruction", "IFBench checkers, loose mode (all instructions must pass)", gold=_gold_spec, any_of=False)
def instruction_loose(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    return _score(answer, ground_truth, task, "loose")


@register("instruction_strict", "IFBench checkers, strict mode (all instructions must pass)", gold=_gold_spec, any_of=False)
def instruction_strict(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    return _score(answer, ground_truth, task, "strict")
