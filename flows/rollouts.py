"""The rollouts flow: write a run's RL data (analysis/rollouts.py) as Parquet files.

    <out>/taskset.parquet        verl/rllm task rows of the tasks the run ran (as recorded)
    <out>/trajectories.parquet   chat messages + loss mask + reward + GRPO/RLOO advantages
    <out>/tokens.parquet         token-level rows (only when the run recorded token ids)

Each loads with `datasets.load_dataset("parquet", data_files=...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from analysis.rollouts import ExportStats, sandbox_prompt, token_rows, trajectory_rows
from analysis.trajectory import TOKEN_SCHEMA, TRAJECTORY_SCHEMA
from datasets_prep.rows import row_schema, task_rows
from flows import artifacts
from warehouse import DEFAULT_ROOT, Warehouse, write_export


def export_taskset(ts: Any, path: Path, source: str = "sandflow") -> Path:
    """A task set as verl/rllm rows (datasets_prep.rows, the one row contract) whose
    prompts are the sandbox episode's own."""
    return write_export(task_rows(ts.tasks, sandbox_prompt, source=source), row_schema(), path)


@flow(name="sandflow-rollouts", log_prints=False)
def rollouts_flow(
    run_id: str,
    warehouse: str = DEFAULT_ROOT,
    out_dir: str | None = None,
    task_set: str | None = None,
    max_seq_tokens: int | None = None,
    overlong: str = "drop",
    verifier: str | None = None,
) -> dict[str, Any]:
    from flows.score import tasks_of_run

    if overlong not in ("drop", "mask", "keep"):
        raise ValueError(f"--overlong {overlong!r}: use drop, mask or keep")
    out = Path(out_dir or Path(warehouse) / "exports" / run_id).expanduser()
    data = Warehouse(warehouse).load_run(run_id, verifier=verifier)
    stats = ExportStats()
    files: dict[str, str] = {}
    try:
        ts = tasks_of_run(warehouse, run_id, task_set)  # the tasks the run ran, as recorded
        files["taskset"] = str(export_taskset(ts, out / "taskset.parquet"))
    except Exception as exc:  # the trajectories are still worth exporting
        files["taskset_error"] = str(exc)
    traj = trajectory_rows(data, max_seq_tokens=max_seq_tokens, overlong=overlong, stats=stats)  # type: ignore[arg-type]
    files["trajectories"] = str(write_export(traj, TRAJECTORY_SCHEMA, out / "trajectories.parquet"))
    tok = token_rows(data, max_seq_tokens=max_seq_tokens, overlong=overlong, stats=stats)  # type: ignore[arg-type]
    if tok:
        files["tokens"] = str(write_export(tok, TOKEN_SCHEMA, out / "tokens.parquet"))
    summary = {"run_id": run_id, "out_dir": str(out), "files": files, **stats.as_dict()}
    if stats.token_mismatches:
        summary["token_mismatch_examples"] = stats.token_mismatches[:5]
    artifacts.table(
        [{"item": k, "value": str(v)} for k, v in summary.items() if k != "files"],
        artifacts.artifact_key("rollouts", run_id),
        f"RL export of run {run_id}",
    )
    return summary
