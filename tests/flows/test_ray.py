"""`--task-runner ray`: a run's episodes as Prefect tasks on a local Ray instance (the
optional extra `ray`: prefect-ray), for real: Docker sandboxes, the scripted model, the
warehouse. verl and LLM-in-Sandbox-RL train on Ray; this is the same runner they use."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.flows.conftest import containers_of, needs, tiny_tasks, write_tasks
from tests.scripted_model import ScriptedModel


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness", "docker_image")
def test_ray_runs_a_benchmark_in_its_worker_processes(tmp_path: Path, model: ScriptedModel) -> None:
    needs("prefect_ray", "the optional extra `ray` (prefect-ray): bash scripts/setup.sh --ray")
    from sandflow.cli import app
    from warehouse.query import connect

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(2))
    wh = tmp_path / "wh"
    res = CliRunner(env={"COLUMNS": "300"}).invoke(
        app,
        ["flows", "run", str(ts), "--base-url", model.url, "--model", "scripted", "--warehouse", str(wh),
         "--mode", "both", "--concurrency", "2", "--max-steps", "6", "--task-runner", "ray"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output + repr(res.exception)
    m = re.search(r"(\S+): 4 recorded, 0 failed", res.output)
    assert m, res.output
    rid = m.group(1)
    with connect(wh) as q:
        rows = q.con.execute(
            f"SELECT mode, count(*) FROM episodes WHERE run_id = '{rid}' AND termination = 'submitted' "
            "GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert rows == [("llm", 2), ("sandbox", 2)]
    # the episodes ran in Ray's worker processes, not in this one
    ran_in = {int(p) for p in re.findall(r"worker pids \[([\d, ]+)\]", res.output)[0].split(", ")}
    assert ran_in and os.getpid() not in ran_in
    assert containers_of(rid) == []
    import ray

    assert not ray.is_initialized()  # the run's Ray instance ended with it
