"""Numbers with a tolerance, and units converted with pint (so 1.5 km == 1500 m).

Ground truth forms: a number; a string such as "9.81 m/s^2"; or a mapping
{"value": 9.81, "unit": "m/s^2", "rel_tol": 0.01, "abs_tol": 0}. An answer without
a unit is read in the ground truth's unit; an answer in an incompatible unit
(seconds for a length) scores 0.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from datasets_prep.verifiers.base import (
    VerifierError,
    VerifierResult,
    register,
    result,
)
from datasets_prep.verifiers.extract import final_answer

if TYPE_CHECKING:
    from datasets_prep.task import Task

DEFAULT_REL_TOL = 0.01

_NUMBER = re.compile(
    r"(?P<num>[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+−]?\.\d+)"
    r"(?:\s*(?:[eE](?P<exp1>[-+−]?\d+)|(?:×|x|\*|\\times|\\cdot)\s*10\s*\^\s*\{?\s*(?P<exp2>[-+−]?\d+)\s*\}?))?"
)


@lru_cache(maxsize=1)
def _ureg() -> Any:
    import pint

    return pint.UnitRegistry()


def clean_latex(s: str) -> str:
    s = s.replace("$", "")
    s = re.sub(r"\\(?:text|mathrm|operatorname|mbox)\s*\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\,", " ").replace("\\;", " ").replace("\\!", "").replace("~", " ")
    s = s.replace("\\%", "%").replace("\\Omega", "ohm").replace("Ω", "ohm").replace("µ", "u").replace("μ", "u")
    s = s.replace("\\circ", "deg").replace("°", "deg ").replace("−", "-")
    s = re.sub(r"\^\s*\{([^{}]*)\}", r"^\1", s)
    return s.strip()


def parse_quantity(text: str) -> tuple[float, str] | None:
    """(value, unit text) from e.g. '1.2 \\times 10^{3} \\text{m/s}'; None if no number."""
    s = clean_latex(text)
    m = _NUMBER.search(s)
    if not m:
        return None
    value = float(m.group("num").replace(",", "").replace("−", "-"))
    exp = m.group("exp1") or m.group("exp2")
    if exp:
        value *= 10 ** int(exp.replace("−", "-"))
    unit = s[m.end() :].strip().rstrip(".").strip()
    unit = re.split(r"\s{2,}|[;\n]| \(| or ", unit)[0].strip()
    if unit.startswith("/") and not unit[1:2].isalpha():
        unit = ""
    return value, unit


def _to_unit(value: float, unit: str, target: str) -> float:
    """Convert value [unit] to target; raises ValueError with a readable reason."""
    if _norm_unit(unit) == _norm_unit(target):
        return value
    ureg = _ureg()
    try:
        q = ureg.Quantity(value, _pint_unit(unit))
        return float(q.to(_pint_unit(target)).magnitude)
    except Exception as e:  # pint raises several error types
        kind = type(e).__name__
        if "Dimensionality" in kind:
            raise ValueError(f"unit {unit!r} is not compatible with {target!r}") from None
        raise ValueError(f"cannot read unit {unit!r}") from None


def _norm_unit(u: str) -> str:
    return re.sub(r"\s+", "", u).replace("**", "^").lower()


def _pint_unit(u: str) -> str:
    u = u.replace("^", "**").replace("·", "*")
    return u or "dimensionless"


def _tolerance(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise VerifierError.wrong(f"numeric {name} must be a number", value)
    try:
        tol = float(value)
    except ValueError:
        raise VerifierError(f"numeric {name} must be a number, got {value!r}") from None
    if not tol >= 0 or tol == float("inf"):  # also NaN
        raise VerifierError(f"numeric {name} must be a finite number >= 0, got {value!r}")
    return tol


def gold_quantity(ground_truth: Any, task: Task | None) -> tuple[float, str, float, float]:
    meta = task.metadata if task else {}
    rel = _tolerance(meta.get("rel_tol", DEFAULT_REL_TOL), "rel_tol")
    abs_ = _tolerance(meta.get("abs_tol", 0.0), "abs_tol")
    gt = ground_truth
    if isinstance(gt, dict):
        if "value" not in gt:
            raise VerifierError(f"numeric ground truth mapping needs a 'value', got keys {sorted(map(str, gt))}")
        rel = _tolerance(gt.get("rel_tol", rel), "rel_tol")
        abs_ = _tolerance(gt.get("abs_tol", abs_), "abs_tol")
        unit = gt.get("unit") or ""
        if not isinstance(unit, str):
            raise VerifierError.wrong("numeric ground truth's unit must be text", unit)
        gt = gt["value"]
    else:
        unit = ""
    if isinstance(gt, bool) or not isinstance(gt, int | float | str):
        raise VerifierError.wrong(
            "numeric ground truth must be a number, a text such as '9.81 m/s^2', or "
            "{'value', 'unit', 'rel_tol'}",
            ground_truth,
        )
    if isinstance(gt, int | float):
        return float(gt), unit, rel, abs_
    parsed = parse_quantity(gt)
    if parsed is None:
        raise VerifierError(f"numeric ground truth has no number: {ground_truth!r}")
    return parsed[0], unit or parsed[1], rel, abs_


def _gold_numeric(ground_truth: Any, task: Task | None) -> None:
    gold_quantity(ground_truth, task)


@register("numeric", "a number within a tolerance (default 1% relative), units converted with pint", gold=_gold_numeric)
def numeric(answer: str, ground_truth: Any, task: Task | None = None) -> VerifierResult:
    gold, unit, rel, abs_ = gold_quantity(ground_truth, task)
    parsed = parse_quantity(final_answer(answer)) or parse_quantity(answer)
    if parsed is None:
        return result(0, "no number found in the answer")
    value, got_unit = parsed
    note = ""
    if unit and got_unit:
        try:
            value = _to_unit(value, got_unit, unit)
        except ValueError as e:
            return result(0, f"{e}", value=parsed[0], unit=got_unit)
    elif unit:
        note = f" (no unit given; read as {unit})"
    ok = math.isclose(value, gold, rel_tol=rel, abs_tol=abs_)
    shown = f"{gold:g}{' ' + unit if unit else ''}"
    verdict = "within" if ok else "outside"
    return result(
        1 if ok else 0,
        f"{value:g} vs {shown}: {verdict} tolerance (rel {rel:g}, abs {abs_:g}){note}",
        value=value,
        expected=gold,
    )
