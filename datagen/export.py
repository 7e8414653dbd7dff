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
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from analysis.rollouts import sandbox_prompt
from analysis.trajectory import sft_row
from datasets_prep.rows import (
    LIS_RL_ROUTES,
    lis_rl_ground_truth,
    lis_rl_route,
    row_schema,
    task_rows,
)
from datasets_prep.task import Task
from warehouse.exports import write_export
from warehouse.rundata import RunData

UNSCORABLE = "lis_rl_unscorable"  # the export's drop reason: no ground-truth text LIS-RL scores


def write_train(tasks: Sequence[Task], path: Path, source: str,
                refused: list[tuple[str, str]] | None = None) -> Path:
    """The tasks as rows; a task LLM-in-Sandbox-RL's reward cannot score goes to `refused`."""
    return write_export(task_rows(tasks, sandbox_prompt, source=source, refused=refused), row_schema(), path)


def lis_rl_summary(tasks: Sequence[Task]) -> dict[str, Any]:
    """How LLM-in-Sandbox-RL's reward reads these rows: per domain its route (None: none,
    and its trainer fails on them), what the scored ground-truth text loses (counted by
    kind), and a warning sentence when a domain has no route."""
    domains = Counter(t.domain for t in tasks)
    notes: Counter[str] = Counter()
    for t in tasks:
        for part in filter(None, lis_rl_ground_truth(t)[1].split("; ")):
            notes[part.split(" (")[0] if part.startswith("exact value") else
                  "only the first accepted answer" if part.startswith("only the first") else part] += 1
    out: dict[str, Any] = {"domains": {d: {"rows": n, "route": lis_rl_route(d)} for d, n in sorted(domains.items())},
                           "notes": dict(sorted(notes.items()))}
    unrouted = [f"{d!r} ({n} rows)" for d, n in sorted(domains.items()) if lis_rl_route(d) is None]
    if unrouted:
        out["warning"] = (f"domain {', '.join(unrouted)} has no route in LLM-in-Sandbox-RL's reward (it routes "
                          f"{', '.join(LIS_RL_ROUTES)}): its trainer fails on these rows; build with "
                          "--domain instruct_pretrain for context-based questions")
    return out


def sft_rows(data: RunData, task_ids: Iterable[str], pass_score: float = 1.0) -> list[dict[str, Any]]:
    """One row per passing, finished episode of the kept tasks (rejection sampling)."""
    keep = set(task_ids)
    rows = []
    for e in data.episodes:
        s = data.scores.get(e.episode_id)
        if e.task_id not in keep or e.is_infra_failure or s is None or s.score < pass_score:
            continue
        rows.append(sft_row(e, data.turns_of(e.episode_id), s.score))
    return rows


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def dataset_card(
    *, build_id: str, stages: Sequence[Mapping[str, Any]], info: Mapping[str, Any],
    files: Mapping[str, tuple[str, int | None]], empty: str | None = None,
    lis_rl: Mapping[str, Any] | None = None,
) -> str:
    """The README.md written beside the data. `files`: name -> (what it is, its rows, None
    for a file that is not a row set); `empty`: the sentence of a build with no rows (its
    card says so first, and shows no load line a loader would crash on)."""
    lines = [f"# {build_id}: RL training data from raw text (sandflow)", ""]
    if empty:
        lines += [f"**Empty: {empty}.**", ""]
    lines += [
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
    for name, (what, _rows) in files.items():
        lines.append(f"- `{name}`: {what}")
    if lis_rl is not None:
        lines += _lis_rl_section(lis_rl)
    loads = [("train", "parquet", "train.parquet", "verl / rllm rows"), ("sft", "json", "sft.jsonl", "messages + tools")]
    lines += ["", "## Loading", "", "```python", "from datasets import load_dataset"]
    for var, kind, name, what in loads:
        if files.get(name, ("", 0))[1]:
            call = f'{var} = load_dataset("{kind}", data_files="{name}")["train"]'
            lines.append(f"{call:<70}  # {what}")
        else:  # `datasets` cannot build an empty split from a file: no line that crashes
            lines.append(f"# {name}: no rows, nothing to load")
    lines += [
        "```",
        "",
        "Provenance of every task (document, span, generator, prompt version, calibration run, "
        "pass rate) is in each row's `extra_info.metadata` and in the warehouse: "
        f"`sandflow sql \"SELECT * FROM task_provenance WHERE build_id = '{build_id}'\"`.",
        "",
    ]
    return "\n".join(lines)


_NOTES = {
    "exact value only": "its reward compares the exact value; the ground truth's tolerance is applied by "
                        "sandflow's verifier only",
    "only the first accepted answer": "its reward credits the first accepted answer only; sandflow's "
                                      "verifier accepts any of them",
}


def _lis_rl_section(lis_rl: Mapping[str, Any]) -> list[str]:
    """What LLM-in-Sandbox-RL's trainer makes of the rows (datasets_prep.rows)."""
    lines = [
        "", "## Training with LLM-in-Sandbox-RL", "",
        "Its rllm environment scores each row with llm-in-sandbox's `instruct_pretrain` reward, "
        "which routes on `extra_info.domain`: " + ", ".join(f"`{d}` ({how})" for d, how in LIS_RL_ROUTES.items())
        + "; a row of any other domain fails the training step. `extra_info.ground_truth` is the "
        "text that reward scores; sandflow's exact ground truth is `reward_model.ground_truth` "
        "(and `extra_info.ground_truth_json`).", "",
    ]
    for d, v in lis_rl.get("domains", {}).items():
        route = v["route"]
        lines.append(f"- domain `{d}`: {v['rows']} rows, " + (f"routed ({route})" if route else "**no route**"))
    for note, n in lis_rl.get("notes", {}).items():
        lines.append(f"- {n} rows: {_NOTES.get(note, note)}")
    if lis_rl.get("warning"):
        lines += ["", f"**Warning: {lis_rl['warning']}.**"]
    return lines
