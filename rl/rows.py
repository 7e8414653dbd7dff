"""A trainer's dataset row -> the `Task` an episode runs.

The row contract is the one LLM-in-Sandbox-RL (rllm + verl) reads: the whole task in
`extra_info` (``id``, ``problem_statement``, ``ground_truth``, ``domain``,
``input_files`` as a JSON object or its text, ``qa_type``), which `sandflow flows
rollouts` writes (flows/rollouts.taskset_rows). Accepted here:

- a whole verl/SkyRL row (its ``extra_info`` is read; ``reward_model.ground_truth`` /
  ``reward_spec.ground_truth`` fill a missing ground truth),
- the ``extra_info`` dict (or its JSON text) alone,
- a `Task`, or a dict in the peer's / sandflow's task format.

A row that cannot make a task raises `RowError` naming the row and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from datasets_prep.task import Task


class RowError(ValueError):
    """The row does not describe a task (the message names the row and the field)."""


def _ground_truth(value: Any) -> Any:
    """Ground truth as the rows carry it: text, JSON text for structured truths (a dict)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        return decoded if isinstance(decoded, dict) else value
    return value


def _input_files(value: Any, where: str) -> dict[str, str | bytes]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"{where}: input_files is not a JSON object ({exc.msg})") from None
    if not isinstance(value, Mapping):
        raise RowError(
            f"{where}: input_files must map file names to text, got {type(value).__name__}"
        )
    out: dict[str, str | bytes] = {}
    for name, content in value.items():
        if content is None:
            continue  # rllm skips these too
        if not isinstance(content, (str, bytes)):
            raise RowError(
                f"{where}: input file {name!r} must be text, got {type(content).__name__}"
            )
        out[str(name)] = content
    return out


def task_from_row(row: Task | Mapping[str, Any] | str, *, where: str = "row") -> Task:
    """The task a row describes (see the module docstring for the shapes accepted)."""
    if isinstance(row, Task):
        return row
    if isinstance(row, str):
        try:
            row = json.loads(row)
        except json.JSONDecodeError as exc:
            raise RowError(f"{where}: not a JSON object ({exc.msg})") from None
    if not isinstance(row, Mapping):
        raise RowError(f"{where}: a row is a mapping (or a Task), got {type(row).__name__}")
    info: Any = row.get("extra_info", row)
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as exc:
            raise RowError(f"{where}: extra_info is not a JSON object ({exc.msg})") from None
    if not isinstance(info, Mapping):
        raise RowError(f"{where}: extra_info must be a mapping, got {type(info).__name__}")
    task_id = info.get("id") or info.get("task_id")
    where = f"{where} (task {task_id!r})" if task_id else where
    gt = info.get("ground_truth")
    if gt is None:
        for key in ("reward_model", "reward_spec"):
            spec = row.get(key)
            if isinstance(spec, Mapping) and spec.get("ground_truth") is not None:
                gt = spec["ground_truth"]
                break
    metadata = info.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata) if metadata else {}
        except json.JSONDecodeError:
            metadata = {"raw": metadata}
    fields: dict[str, Any] = {
        "id": task_id,
        "domain": info.get("domain") or row.get("ability"),
        "problem_statement": info.get("problem_statement"),
        "ground_truth": _ground_truth(gt),
        "input_files": _input_files(info.get("input_files"), where),
        "qa_type": info.get("qa_type"),
        "verifier": info.get("verifier") or "auto",
        "metadata": metadata if isinstance(metadata, Mapping) else {},
    }
    for key in ("id", "domain", "problem_statement"):
        if not fields[key]:
            raise RowError(
                f"{where}: field {key!r} is missing or empty (expected in extra_info, the "
                "LLM-in-Sandbox-RL row contract: id, problem_statement, ground_truth, domain, "
                "input_files, qa_type)"
            )
    try:
        return Task(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ())) or "task"
        raise RowError(f"{where}: {loc}: {first.get('msg')}") from None
