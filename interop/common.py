"""Small conversions every format needs: timestamps, tool-call arguments, versions."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from tasks.replies import read_arguments


def iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


@cache
def sandflow_version() -> str:
    try:
        return version("sandflow")
    except PackageNotFoundError:
        return "unknown"


def parse_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    """A tool call's raw JSON text -> (object, None), or ({}, why) when it is not a JSON
    object (the model may write anything there; the raw text is kept by the caller).
    tasks.replies' rule: bounded nesting, so no arguments can crash an export."""
    return read_arguments(raw)


def text_of(content: Any) -> str:
    """A message's content as text (lists of parts and other JSON become JSON text)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return json.dumps(content, ensure_ascii=False)


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def verdict(ep: Any) -> dict[str, Any]:
    """How the episode ended and how it was judged (`ep`: an interop.source.Episode)."""
    e, s = ep.record, ep.score
    return {
        "termination": e.termination,
        "infra_failure": e.is_infra_failure,
        "error": e.error,
        "answer": e.answer,
        "answer_source": e.answer_source,
        "score": s.score if s else None,
        "passed": s.passed if s else None,
        "verifier": s.verifier if s else None,
    }


def outcome(o: Any) -> dict[str, Any]:
    """A tool call's outcome without its text: exit code, time-out, OOM kill, truncation,
    error, duration (and the call id and tool name)."""
    return dict(o.model_dump(exclude={"content"}))
