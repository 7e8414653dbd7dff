"""Turn warehouse rows into what a page shows: parsed tool calls, folded outputs, numbers.

Nothing here produces HTML: the templates do, with autoescaping, so everything the model
wrote reaches the browser as text. Sizes are bounded here: a field longer than
MAX_FIELD_CHARS is cut (the page says so and where the rest is), and long text is split
into a visible head and a folded rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tasks.replies import read_arguments

MAX_FIELD_CHARS = 200_000  # per text field on a page; the warehouse keeps it all
MAX_JSON_CHARS = 100_000  # tool-call arguments parsed for display up to this size
FOLD_LINES = 20
FOLD_CHARS = 2_000


@dataclass
class Folded:
    """A text split into what is shown and what is folded."""

    head: str
    rest: str = ""
    lines: int = 0
    chars: int = 0
    cut: int = 0  # characters dropped beyond MAX_FIELD_CHARS

    @property
    def folded(self) -> bool:
        return bool(self.rest)

    @property
    def rest_lines(self) -> int:
        return self.rest.count("\n") + (1 if self.rest and not self.rest.endswith("\n") else 0)


def fold(text: str | None, lines: int = FOLD_LINES, chars: int = FOLD_CHARS) -> Folded:
    """Show the first `lines` lines (at most `chars` characters); fold the rest."""
    if not text:
        return Folded("")
    total = len(text)
    cut = max(0, total - MAX_FIELD_CHARS)
    if cut:
        text = text[:MAX_FIELD_CHARS]
    n_lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    end = 0
    for _ in range(lines):
        nl = text.find("\n", end)
        if nl < 0:
            end = len(text)
            break
        end = nl + 1
    end = min(end, chars)
    if len(text) - end <= 40:  # not worth folding a few characters
        end = len(text)
    return Folded(text[:end], text[end:], n_lines, total, cut)


@dataclass
class Arg:
    name: str
    value: str
    block: bool  # shown as a code block (multi-line / long) or inline


@dataclass
class CallView:
    index: int
    id: str | None
    name: str
    raw_arguments: str
    valid_json: bool
    headline: str | None  # the command, or "<command> <path>" for the editor
    args: list[Arg]
    observation: dict[str, Any] | None
    output: Folded
    labels: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TurnView:
    index: int
    row: dict[str, Any]
    assistant: Folded
    reasoning: Folded
    calls: list[CallView]
    stray_observations: list[tuple[dict[str, Any], Folded]]
    extra_messages: list[dict[str, Any]]
    turn_labels: list[dict[str, Any]]  # labels not tied to a call (call_index -1)


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    return json.dumps(v, ensure_ascii=False, indent=1, default=str)


def parse_arguments(name: str, raw: str | None) -> tuple[bool, str | None, list[Arg]]:
    """(valid JSON?, headline, arguments) of one tool call, for display."""
    raw = raw or ""
    if len(raw) > MAX_JSON_CHARS:
        return False, None, [Arg("arguments", raw[:MAX_FIELD_CHARS], True)]
    parsed, problem = read_arguments(raw)  # tasks.replies' rule: bounded nesting
    if problem is not None:
        return False, None, [Arg("arguments", raw, True)] if raw else []
    headline = None
    rest = dict(parsed)
    if name == "execute_bash" and isinstance(rest.get("command"), str):
        headline = rest.pop("command")
    elif name == "str_replace_editor":
        cmd, path = rest.get("command"), rest.get("path")
        if isinstance(cmd, str) and isinstance(path, str):
            headline = f"{rest.pop('command')} {rest.pop('path')}"
    args = []
    for k, v in rest.items():
        s = _text(v)
        args.append(Arg(str(k), s, "\n" in s or len(s) > 80))
    return True, headline, args


def turn_view(row: dict[str, Any], labels: dict[tuple[int, int], list[dict[str, Any]]]) -> TurnView:
    idx = int(row["turn_index"])
    observations = list(row.get("observations") or [])
    by_id: dict[str, dict[str, Any]] = {}
    for o in observations:
        if o.get("tool_call_id") is not None and o["tool_call_id"] not in by_id:
            by_id[o["tool_call_id"]] = o
    used: set[int] = set()
    calls = []
    for ci, call in enumerate(row.get("tool_calls") or []):
        name = call.get("name") or "?"
        valid, headline, args = parse_arguments(name, call.get("arguments"))
        obs = by_id.get(call.get("id")) if call.get("id") is not None else None
        if obs is not None:
            used.add(id(obs))
        calls.append(
            CallView(
                index=ci,
                id=call.get("id"),
                name=name,
                raw_arguments=(call.get("arguments") or "")[:MAX_FIELD_CHARS],
                valid_json=valid,
                headline=headline,
                args=args,
                observation=obs,
                output=fold(obs.get("content") if obs else None),
                labels=labels.get((idx, ci), []),
            )
        )
    stray = [(o, fold(o.get("content"))) for o in observations if id(o) not in used]
    extra: list[dict[str, Any]] = []
    raw_extra = row.get("extra_messages")
    if raw_extra:
        try:
            loaded = json.loads(raw_extra) if isinstance(raw_extra, str) else raw_extra
        except ValueError:
            loaded = [{"role": "?", "content": raw_extra}]
        if isinstance(loaded, list):
            for m in loaded[:50]:
                if isinstance(m, dict):
                    extra.append(
                        {"role": str(m.get("role", "?")), "content": fold(_text(m.get("content")))}
                    )
    return TurnView(
        index=idx,
        row=row,
        assistant=fold(row.get("assistant_content"), lines=60, chars=8_000),
        reasoning=fold(row.get("reasoning_content"), lines=60, chars=8_000),
        calls=calls,
        stray_observations=stray,
        extra_messages=extra,
        turn_labels=labels.get((idx, -1), []),
    )


def prompt_messages(raw: str | None) -> list[dict[str, Any]]:
    """The episode's opening messages (system + task), folded."""
    if not raw:
        return []
    try:
        loaded = json.loads(raw)
    except ValueError:
        return [{"role": "?", "content": fold(raw)}]
    if not isinstance(loaded, list):
        return []
    out = []
    for m in loaded[:20]:
        if isinstance(m, dict):
            out.append(
                {
                    "role": str(m.get("role", "?")),
                    "content": fold(_text(m.get("content")), lines=40, chars=6_000),
                }
            )
    return out


def pretty_json(raw: Any) -> str:
    """A JSON text (config, score details) indented; the text as is if it is not JSON."""
    if raw is None:
        return ""
    if not isinstance(raw, str):
        return _text(raw)
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False, indent=1, sort_keys=True)[
            :MAX_FIELD_CHARS
        ]
    except ValueError:
        return raw[:MAX_FIELD_CHARS]


# ---- numbers for the templates -------------------------------------------------------
def num(v: Any, digits: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "—"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}".rstrip("0").rstrip(".") or "0"
    return str(v)


def usd(v: Any) -> str:
    """Dollars to 1/100 of a cent; "unknown" for None (no price for the model, or a turn
    without usage: warehouse/cost.py), never 0 or a blank that reads as free."""
    if v is None:
        return "unknown"
    return f"${float(v):,.4f}"


def seconds(v: Any) -> str:
    if v is None:
        return "—"
    v = float(v)
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 120:
        return f"{v:.1f} s"
    return f"{v / 60:.1f} min"


def when(v: Any) -> str:
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    return "—" if v is None else str(v)


def score_class(score: Any) -> str:
    if score is None:
        return "unscored"
    if score >= 1:
        return "correct"
    if score <= 0:
        return "incorrect"
    return "partial"


def short(text: Any, n: int = 80) -> str:
    s = "" if text is None else str(text)
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def cell(v: Any, n: int = 300) -> str:
    """One SQL result value as text: JSON for lists and structs, cut to `n` characters."""
    if isinstance(v, dict | list | tuple):
        s = json.dumps(v, ensure_ascii=False, default=str)
    elif isinstance(v, float):
        s = num(v, 4)
    elif isinstance(v, datetime):
        s = v.isoformat(sep=" ")
    else:
        s = str(v)
    return s if len(s) <= n else s[: n - 1] + "…"
