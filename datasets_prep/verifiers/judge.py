"""An optional LLM judge through any OpenAI-compatible endpoint.

Used only when asked for (verifier="judge"): it is not pure in the strict sense
(it calls a model), so it is never chosen by `auto`. Its endpoint is an input like the
answer: a `JudgeEndpoint` handed to `score(..., judge=...)` by the application, which
resolves it from SANDFLOW_JUDGE_BASE_URL / _MODEL / _API_KEY (sandflow.config); this
library never reads settings. The key never appears in a result or a dump.
Temperature 0; the openai client retries transient errors.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, SecretStr

from datasets_prep.verifiers.base import VerifierError, VerifierResult, as_text, register, result

if TYPE_CHECKING:
    from datasets_prep.task import Task

JUDGE_PROMPT = """You are grading an answer against a reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{answer}

Is the answer correct, judged by meaning rather than wording? Reply with JSON only:
{{"score": <number from 0 to 1>, "reason": "<one short sentence>"}}"""

MAX_ANSWER_CHARS = 8000
NOT_CONFIGURED = (
    "the judge verifier needs an endpoint: set SANDFLOW_JUDGE_BASE_URL and SANDFLOW_JUDGE_MODEL "
    "(and SANDFLOW_JUDGE_API_KEY if the server wants one)"
)


class JudgeEndpoint(BaseModel):
    """Where the judge model is served. The key is excluded from every dump."""

    base_url: str
    model: str
    api_key: SecretStr | None = Field(None, exclude=True, repr=False)
    timeout_s: float = 120.0


@lru_cache(maxsize=4)
def _client(base_url: str, api_key: str, timeout: float) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=api_key or "not-needed", timeout=timeout, max_retries=3)


def parse_verdict(text: str) -> tuple[float, str]:
    """{"score": x, "reason": ...} from the judge's reply (tolerates code fences and prose)."""
    m = re.search(r"\{.*\}", text or "", re.DOTALL)
    if m:
        try:
            obj = json.loads(m.group(0))
            score = float(obj["score"])
            if not 0.0 <= score <= 1.0:
                raise ValueError
            return score, str(obj.get("reason", ""))[:300]
        except (ValueError, KeyError, TypeError):
            pass
    word = re.search(r"\b(CORRECT|INCORRECT)\b", (text or "").upper())
    if word:
        return (1.0 if word.group(1) == "CORRECT" else 0.0), "verdict word"
    raise VerifierError(f"the judge's reply has no score: {(text or '')[:120]!r}")


def _gold_reference(ground_truth: Any, task: Task | None) -> None:
    """Any JSON value can be shown to a judge as the reference; an empty one cannot."""
    if ground_truth is None or (isinstance(ground_truth, str | list | dict) and not ground_truth):
        raise VerifierError("the judge needs a reference answer; the ground truth is empty")
    try:
        json.dumps(ground_truth)
    except (TypeError, ValueError):
        raise VerifierError(f"the judge's reference must be JSON, got {type(ground_truth).__name__}") from None


@register(
    "judge", "an LLM judge via an OpenAI-compatible endpoint (SANDFLOW_JUDGE_*), on request only",
    gold=_gold_reference, any_of=False,  # the judge is shown the whole reference, list or not
    text=False,  # a missing endpoint is the caller's error, even for an empty answer
)
def judge(
    answer: Any, ground_truth: Any, task: Task | None = None, *, endpoint: JudgeEndpoint | None = None
) -> VerifierResult:
    if endpoint is None:
        raise VerifierError(NOT_CONFIGURED)
    text = as_text(answer)
    if text is None:
        return result(0, "empty answer")
    question = (task.metadata.get("question") or task.problem_statement) if task else "(not given)"
    prompt = JUDGE_PROMPT.format(
        question=str(question)[:MAX_ANSWER_CHARS],
        reference=ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth),
        answer=text[-MAX_ANSWER_CHARS:],
    )
    key = endpoint.api_key.get_secret_value() if endpoint.api_key else ""
    client = _client(endpoint.base_url, key, endpoint.timeout_s)
    try:
        reply = client.chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": prompt}], temperature=0.0, max_tokens=200
        )
    except Exception as e:  # openai raises many types; the judge failing is not the answer's fault
        raise VerifierError(f"the judge endpoint failed: {type(e).__name__}: {str(e)[:200]}") from None
    content = reply.choices[0].message.content or ""
    score, why = parse_verdict(content)
    return result(score, f"judge ({endpoint.model}): {why}", judge_model=endpoint.model)
