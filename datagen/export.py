"""Export: the calibrated tasks as training data, and a dataset card beside them.

    train.parquet   verl / rllm rows in the LIS-RL contract (datasets_prep.rows.task_rows:
                    the sandbox episode's own prompt; the whole task in extra_info)
    sft.jsonl       rejection-sampled SFT data: the calibration run's passing trajectories
                    as chat messages with tool calls, each row with the `tools` list
                    (the layout TRL's SFTTrainer and LLaMA-Factory's OpenAI-style
                    datasets read: {"messages": [...], "tools": [...]})
    README.md       the dataset card: counts per stage, generator model, prompt versions,
                    decontamination sets, band, calibration run, how to load it
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from analysis.rollouts import episode_messages, sandbox_prompt
from datasets_prep.rows import row_schema, task_rows
from datasets_prep.task import Task
from tasks.tools import TOOL_SCHEMAS
from warehouse.exports import write_export
from warehouse.rundata import RunData


def write_train(tasks: Sequence[Task], path: Path, source: str) -> Path:
    return write_export(task_rows(tasks, sandbox_prompt, source=source), row_schema(), path)


def _arguments(text: str | None) -> Any:
    """Tool-call arguments as an object (chat templates render them with tojson)."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return text or ""
    return value


def sft_message(m: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": "function",
             "function": {"name": (c.get("function") or {}).get("name"),
                          "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
            for c in calls
        ]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
        if m.get("name"):
            out["name"] = m["name"]
    return out


def sft_rows(data: RunData, task_ids: Iterable[str], pass_score: float = 1.0) -> list[dict[str, Any]]:
    """One row per passing, finished episode of the kept tasks (rejection sampling)."""
    keep = set(task_ids)
    rows = []
    for e in data.episodes:
        s = data.scores.get(e.episode_id)
        if e.task_id not in keep or e.is_infra_failure or s is None or s.score < pass_score:
            continue
        msgs = [sft_message(m) for m in episode_messages(e, data.turns_of(e.episode_id))]
        rows.append({"messages": msgs, "tools": TOOL_SCHEMAS, "task_id": e.task_id,
                     "episode_id": e.episode_id, "reward": s.score})
    return rows


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def dataset_card(
    *, build_id: str, stages: Sequence[Mapping[str, Any]], info: Mapping[str, Any], files: Mapping[str, str]
) -> str:
    """The README.md written beside the data."""
    lines = [
        f"# {build_id}: RL training data from raw text (sandflow)",
        "",
        "Context-based questions of the three LIS-RL types (single choice, multiple choice "
        "\"A, C\", free form), synthesized from a corpus, checked, deduplicated, decontaminated "
        "and calibrated against a base policy in the sandbox. Each task's documents go into the "
        "sandbox as files; the reward is the task's verifier (exact match, F1, math-verify then "
        "ROUGE-L).",
        "",
        "## Funnel",
        "",
        "| stage | in | out | dropped | dropped by reason |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for s in stages:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(s["dropped"].items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"| {s['stage']} | {s['items_in']} | {s['items_out']} | "
                     f"{sum(s['dropped'].values())} | {reasons or '-'} |")
    lines += ["", "## How it was made", ""]
    for key, label in (
        ("corpus", "corpus"), ("generator_model", "generator model"), ("prompt_version", "prompt template"),
        ("structured_output", "structured output"), ("questions_per_piece", "questions per piece"),
        ("synth_tokens", "synthesis tokens (prompt / completion)"),
        ("decontamination_sets", "decontamination sets"), ("ngram", "decontamination n-gram"),
        ("near_dup_threshold", "near-duplicate Jaccard threshold"), ("policy_model", "base policy"),
        ("calibration_run", "calibration run"), ("samples", "samples per task"), ("band", "pass-rate band"),
    ):
        if info.get(key) not in (None, "", []):
            value = info[key]
            if isinstance(value, list | tuple):
                value = ", ".join(map(str, value))
            lines.append(f"- {label}: `{value}`")
    lines += ["", "## Files", ""]
    for name, what in files.items():
        lines.append(f"- `{name}`: {what}")
    lines += [
        "",
        "## Loading",
        "",
        "```python",
        "from datasets import load_dataset",
        'train = load_dataset("parquet", data_files="train.parquet")["train"]   # verl / rllm rows',
        'sft = load_dataset("json", data_files="sft.jsonl")["train"]            # messages + tools',
        "```",
        "",
        "Provenance of every task (document, span, generator, prompt version, calibration run, "
        "pass rate) is in each row's `extra_info.metadata` and in the warehouse: "
        f"`sandflow sql \"SELECT * FROM task_provenance WHERE build_id = '{build_id}'\"`.",
        "",
    ]
    return "\n".join(lines)
