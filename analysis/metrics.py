"""The numbers the paper reports, computed from one run's records.

Pure functions of a RunData -> plain rows (list of dicts), so the report, the
Prefect artifacts, the CLI tables and the tests all read the same figures.

- accuracy: mean reward per domain x mode (infrastructure failures left out: they
  are not the model's answer; they are counted separately).
- usage: the paper's capability rates: the share of a domain x mode's turns that
  use each capability (analysis/usage_rules.py decides). A turn may use several.
- tokens: prompt / completion tokens per episode and per domain x mode, and the
  sandbox-to-LLM ratio: mean tokens per episode in sandbox mode over LLM mode, per
  domain and overall, on the tasks that ran in both modes (paired, as the paper).
- turns per episode and termination reasons.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from statistics import mean, median
from typing import Any

from analysis.usage_rules import CAPABILITIES, label_tool_call, primary_label
from tasks.replies import read_arguments
from warehouse.rundata import RunData

ALL = "(all)"


# ------------------------------------------------------------------------------ usage
def usage_call_rows(data: RunData) -> list[dict[str, Any]]:
    """One row per (turn, tool call, capability), 'none' when a call uses none.

    This is what the warehouse's usage table stores; a turn without tool calls gets
    one row with call_index -1 and capability 'none' so every turn is represented.
    """
    rows: list[dict[str, Any]] = []
    for e in data.episodes:
        for t in data.turns_of(e.episode_id):
            traffic = egress_detail(t)
            if traffic:  # real traffic through the egress proxy: the label comes from it
                row = _usage_row(e.episode_id, t.turn_index, -1, "external_resource", "egress", traffic)
                rows.append(row)
            elif not t.tool_calls:
                rows.append(_usage_row(e.episode_id, t.turn_index, -1, "none", None, None))
            for ci, call in enumerate(t.tool_calls):
                caps = label_tool_call(call.name, call.arguments)
                detail = _detail(call.name, call.arguments)
                for cap in sorted(caps) or ["none"]:
                    rows.append(_usage_row(e.episode_id, t.turn_index, ci, cap, call.name, detail))
    return rows


def egress_detail(turn: Any) -> str | None:
    """'egress: N requests (host:port, ...)' for a turn with allowed requests through the
    egress proxy (network allowlist/open), else None."""
    allowed = [r for r in getattr(turn, "egress", None) or [] if r.allowed]
    if not allowed:
        return None
    hosts = sorted({f"{r.host}:{r.port}" for r in allowed})
    return f"egress: {len(allowed)} requests ({', '.join(hosts[:5])})"[:200]


def _detail(name: str, arguments: str) -> str | None:
    args, problem = read_arguments(arguments)
    if problem is not None:
        return None
    text = args.get("command") if name != "str_replace_editor" else f"{args.get('command')} {args.get('path')}"
    return str(text)[:200] if text is not None else None


def _usage_row(
    episode_id: str, turn: int, call: int, cap: str, tool: str | None, detail: str | None
) -> dict[str, Any]:
    return {
        "episode_id": episode_id,
        "turn_index": turn,
        "call_index": call,
        "capability": cap,
        "tool": tool,
        "detail": detail,
    }


def turn_labels(data: RunData) -> list[dict[str, Any]]:
    """One row per turn of a sandbox-mode episode: its capabilities and primary label."""
    rows = []
    for e in data.episodes:
        if e.mode != "sandbox" or e.is_infra_failure:
            continue
        for t in data.turns_of(e.episode_id):
            caps: set[str] = set()
            for call in t.tool_calls:
                caps |= label_tool_call(call.name, call.arguments)
            if egress_detail(t):
                caps.add("external_resource")
            rows.append(
                {
                    "episode_id": e.episode_id,
                    "domain": e.domain,
                    "mode": e.mode,
                    "turn_index": t.turn_index,
                    "capabilities": sorted(caps),
                    "primary": primary_label(caps),
                }
            )
    return rows


def usage_rates(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Share of turns (in %) using each capability, per domain x mode and overall."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["domain"], r["mode"])].append(r)
        groups[(ALL, r["mode"])].append(r)
    out = []
    for (domain, mode), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] == ALL, kv[0])):
        n = len(rs)
        row: dict[str, Any] = {"domain": domain, "mode": mode, "turns": n}
        for cap in CAPABILITIES:
            row[cap] = round(100.0 * sum(cap in r["capabilities"] for r in rs) / n, 1)
        row["none"] = round(100.0 * sum(not r["capabilities"] for r in rs) / n, 1)
        out.append(row)
    return out


# --------------------------------------------------------------------------- accuracy
def accuracy(data: RunData) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    infra: Counter[tuple[str, str]] = Counter()
    for e in data.episodes:
        if e.is_infra_failure or e.termination is None:
            infra[(e.domain, e.mode)] += 1
            infra[(ALL, e.mode)] += 1
            continue
        s = data.scores.get(e.episode_id)
        if s is None:
            continue
        groups[(e.domain, e.mode)].append(s.score)
        groups[(ALL, e.mode)].append(s.score)
    keys = sorted(set(groups) | set(infra), key=lambda k: (k[0] == ALL, k))
    return [
        {
            "domain": d,
            "mode": m,
            "episodes": len(groups.get((d, m), [])),
            "accuracy": round(100.0 * mean(groups[(d, m)]), 1) if groups.get((d, m)) else None,
            "infra_failures": infra.get((d, m), 0),
        }
        for d, m in keys
    ]


# ----------------------------------------------------------------------------- tokens
def episode_tokens(data: RunData) -> list[dict[str, Any]]:
    return [
        {
            "episode_id": e.episode_id,
            "task_id": e.task_id,
            "domain": e.domain,
            "mode": e.mode,
            "sample_index": e.sample_index,
            "prompt_tokens": e.prompt_tokens,
            "completion_tokens": e.completion_tokens,
            "cached_tokens": e.cached_tokens,
            "total_tokens": e.prompt_tokens + e.completion_tokens,
            "num_turns": e.num_turns,
        }
        for e in data.episodes
        if not e.is_infra_failure and e.termination is not None
    ]


def token_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean tokens per episode per domain x mode, and the paired sandbox/LLM ratio."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["domain"], r["mode"])].append(r)
        by[(ALL, r["mode"])].append(r)
    ratios = sandbox_llm_ratio(rows)
    out = []
    for (d, m), rs in sorted(by.items(), key=lambda kv: (kv[0][0] == ALL, kv[0])):
        out.append(
            {
                "domain": d,
                "mode": m,
                "episodes": len(rs),
                "prompt_tokens": round(mean(r["prompt_tokens"] for r in rs), 1),
                "completion_tokens": round(mean(r["completion_tokens"] for r in rs), 1),
                "total_tokens": round(mean(r["total_tokens"] for r in rs), 1),
                "sandbox_to_llm": ratios.get(d) if m == "sandbox" else None,
            }
        )
    return out


def sandbox_llm_ratio(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per domain (and ALL): mean total tokens per task in sandbox mode / in LLM mode.

    Only tasks that ran in both modes count, so the two sides cover the same questions.
    """
    per_task: dict[tuple[str, str], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        per_task[(r["domain"], r["task_id"])][r["mode"]].append(r["total_tokens"])
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (domain, _task), modes in per_task.items():
        if modes.get("sandbox") and modes.get("llm"):
            s, llm = mean(modes["sandbox"]), mean(modes["llm"])
            for key in (domain, ALL):
                sums[key][0] += s
                sums[key][1] += llm
    return {k: (round(v[0] / v[1], 3) if v[1] else None) for k, v in sums.items()}


# ---------------------------------------------------------------- turns & terminations
def turns_summary(data: RunData) -> list[dict[str, Any]]:
    by: dict[tuple[str, str], list[int]] = defaultdict(list)
    for e in data.episodes:
        if e.termination is None or e.is_infra_failure:
            continue
        by[(e.domain, e.mode)].append(e.num_turns)
    return [
        {
            "domain": d,
            "mode": m,
            "episodes": len(v),
            "mean_turns": round(mean(v), 2),
            "median_turns": median(v),
            "max_turns": max(v),
        }
        for (d, m), v in sorted(by.items())
    ]


def terminations(data: RunData) -> list[dict[str, Any]]:
    c: Counter[tuple[str, str]] = Counter((e.mode, e.termination or "unfinished") for e in data.episodes)
    return [{"mode": m, "termination": t, "episodes": n} for (m, t), n in sorted(c.items())]
