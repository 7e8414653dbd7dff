"""verl/rllm task rows: read back the way LLM-in-Sandbox-RL's trainer reads them.

verl's RLHFDataset loads the Parquet with `datasets` and hands each row's `extra_info`
to the rollout; LLM-in-Sandbox-RL's rllm environment (`LLMinSandboxEnv.from_dict`) builds
the whole episode from that dict: `problem_statement`, `ground_truth`, `domain`,
`input_files` (a JSON string or a dict), `qa_type`, `id`. Its `prompt` is a placeholder.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from datasets_prep.task import Task


def _tasks() -> list[Task]:
    return [
        Task(
            id="math-1",
            domain="math",
            problem_statement="What is 6 * 7? Give {braces} too.",
            ground_truth="42",
            qa_type="math",
            input_files={"notes/a.txt": "first line\nsecond line\n", "b.csv": "x,y\n1,2\n"},
        ),
        Task(
            id="phys-2",
            domain="physics",
            problem_statement="How fast? Answer in m/s.",
            ground_truth={"value": 3.0, "unit": "m/s", "rel_tol": 0.01},
            qa_type="numeric",
        ),
    ]


def _rllm_entry(extra_info: dict[str, Any] | str) -> dict[str, Any]:
    """What LLMinSandboxEnv.from_dict / reset / compute_final_reward take from a row."""
    entry = json.loads(extra_info) if isinstance(extra_info, str) else dict(extra_info)
    for k in ("docker_image", "step_timeout", "verbose", "working_dir", "input_dir", "output_dir"):
        entry.pop(k, None)
    files = entry.get("input_files")
    if isinstance(files, str):
        files = json.loads(files) if files else {}
    return {
        "problem_statement": entry.get("problem_statement", ""),
        "ground_truth": entry["ground_truth"],
        "domain": entry["domain"],
        "input_files": files or {},
        "qa_type": entry.get("qa_type"),
        "id": entry.get("id"),
        "reward_kwargs": {k: v for k, v in entry.items() if k != "ground_truth"},
    }


def test_exported_rows_carry_the_whole_task_for_rllm_and_keep_verl_fields(tmp_path: Path) -> None:
    import datasets

    from flows.rollouts import export_taskset

    tasks = _tasks()
    path = export_taskset(SimpleNamespace(tasks=tasks), tmp_path / "taskset.parquet")
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    assert len(ds) == 2
    for i, (row, task) in enumerate(zip(ds, tasks, strict=True)):
        # verl's fields, unchanged
        assert row["data_source"] == f"sandflow/{task.domain}"
        assert row["ability"] == task.domain
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert task.problem_statement in row["prompt"][1]["content"]
        assert row["reward_model"]["style"] == "rule"
        assert row["extra_info"]["index"] == i
        assert row["extra_info"]["split"] == "train"
        # rllm's contract: the whole task in extra_info
        entry = _rllm_entry(row["extra_info"])
        assert entry["problem_statement"] == task.problem_statement
        assert entry["domain"] == task.domain
        assert entry["id"] == task.id
        assert entry["qa_type"] == task.qa_type
        assert entry["input_files"] == task.input_files
        assert isinstance(entry["ground_truth"], str)
    # the entry's ground truth is the text LIS-RL's reward scores (a quantity's number: its
    # JSON text scored 0 for every right answer, issue #36); verl's reward_model keeps
    # sandflow's own text, and ground_truth_json the exact value
    assert _rllm_entry(ds[0]["extra_info"])["ground_truth"] == "42" == ds[0]["reward_model"]["ground_truth"]
    assert _rllm_entry(ds[1]["extra_info"])["ground_truth"] == "3"
    assert json.loads(ds[1]["reward_model"]["ground_truth"]) == tasks[1].ground_truth
    assert json.loads(ds[1]["extra_info"]["ground_truth_json"]) == tasks[1].ground_truth


def test_rows_round_trip_into_sandflow_tasks(tmp_path: Path) -> None:
    """The same rows drive sandflow's own environment (datasets_prep.rows.task_from_row)."""
    import datasets

    from datasets_prep.rows import task_from_row
    from flows.rollouts import export_taskset

    tasks = _tasks()
    path = export_taskset(SimpleNamespace(tasks=tasks), tmp_path / "taskset.parquet")
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    for row, task in zip(ds, tasks, strict=True):
        back = task_from_row(row)
        assert back.id == task.id
        assert back.problem_statement == task.problem_statement
        assert back.ground_truth == task.ground_truth
        assert back.input_files == task.input_files
        assert back.domain == task.domain and back.qa_type == task.qa_type
