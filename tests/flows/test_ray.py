"""`--task-runner ray`: a run's episodes as Prefect tasks on a local Ray instance (the
optional extra `ray`: prefect-ray), for real: Docker sandboxes, the scripted model, the
warehouse. verl and LLM-in-Sandbox-RL train on Ray; this is the same runner they use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.flows.conftest import benchmark_on, needs, worker_pids
from tests.scripted_model import ScriptedModel


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness", "docker_image")
def test_ray_runs_a_benchmark_in_its_worker_processes(tmp_path: Path, model: ScriptedModel) -> None:
    needs("prefect_ray", "the optional extra `ray` (prefect-ray): bash scripts/setup.sh --ray")
    _, output = benchmark_on(["--concurrency", "2", "--task-runner", "ray"], tmp_path, model)
    ran_in = worker_pids(output)  # the episodes ran in Ray's worker processes, not in this one
    assert ran_in and os.getpid() not in ran_in
    import ray

    assert not ray.is_initialized()  # the run's Ray instance ended with it
