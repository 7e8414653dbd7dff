"""Scale-out and scheduling, for real:

- a Dask scheduler and two worker processes on 127.0.0.1 run a small benchmark through
  `sandflow flows run --task-runner dask --dask-address tcp://...`;
- prefect.yaml registers against a real `prefect server start --host 127.0.0.1` (free
  port, temp PREFECT_HOME) with `prefect --no-prompt deploy --name ...`, and the server's
  scheduler creates the 02:00 runs with their parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.flows.conftest import benchmark_on, worker_pids
from tests.flows.prefect_servers import REPO, api, prefect
from tests.flows.prefect_servers import prefect_server as running_server
from tests.scripted_model import ScriptedModel


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness", "docker_image")
def test_dask_cluster_runs_a_benchmark(tmp_path: Path, model: ScriptedModel) -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=2, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0"
    ) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tcp://127.0.0.1:")
        worker_pids_ = {w.pid for w in cluster.workers.values()}
        with Client(cluster) as client:
            callbacks = client.run(lambda dask_worker: sorted(dask_worker.periodic_callbacks))
        # importing flows turns the workers' stack profiler off: on CPython 3.11 it can
        # deadlock a worker for good (flows/prefect_env.py)
        assert callbacks and all("profile" not in cbs for cbs in callbacks.values()), callbacks
        _, output = benchmark_on(
            ["--concurrency", "4", "--task-runner", "dask", "--dask-address", address], tmp_path, model
        )
    # the episodes ran in the Dask worker processes, not in this one
    ran_in = worker_pids(output)
    assert ran_in and ran_in <= worker_pids_ and os.getpid() not in ran_in


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A real Prefect server on 127.0.0.1 with its own PREFECT_HOME; yields a client env."""
    with running_server(tmp_path, PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="3") as env:
        yield env


@pytest.mark.slow
def test_prefect_yaml_deploys_against_a_real_server(prefect_server: dict[str, str], tmp_path: Path) -> None:
    env = dict(prefect_server, SANDFLOW_REPO=str(REPO))
    r = prefect(env, "work-pool", "create", "sandflow-process", "--type", "process")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("nightly", "rl-data", "data-build", "train"):
        r = prefect(env, "--no-prompt", "deploy", "--name", name)
        assert r.returncode == 0, r.stdout + r.stderr
    deps = {d["name"]: d for d in api(env, "/deployments/filter", {})}
    assert set(deps) == {"nightly", "rl-data", "data-build", "train"}
    assert deps["train"]["entrypoint"] == "sandflow/deployments.py:train_flow"
    assert deps["train"]["parameters"]["config"]["tasks"] == "smoke"
    assert deps["data-build"]["entrypoint"] == "sandflow/deployments.py:data_build_job"
    assert deps["data-build"]["parameters"]["decontaminate"] == ["smoke"]
    nightly = deps["nightly"]
    assert nightly["work_pool_name"] == "sandflow-process"
    assert nightly["entrypoint"] == "sandflow/deployments.py:nightly_flow"  # settings handed down first
    assert nightly["parameters"]["source"] == "smoke" and nightly["parameters"]["mode"] == "both"
    crons = [s["schedule"]["cron"] for s in nightly["schedules"]]
    assert crons == ["0 2 * * *"]
    # the pull step names the repo explicitly (not the deploying shell's cwd by accident)
    assert nightly["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
    assert deps["rl-data"]["parameters"]["samples"] == 8 and deps["rl-data"]["schedules"] == []
    # the server's scheduler creates the nightly runs at 02:00 UTC with the parameters
    deadline = time.monotonic() + 90
    runs: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not runs:
        runs = api(env, "/flow_runs/filter", {"deployments": {"id": {"any_": [nightly["id"]]}}})
        time.sleep(2)
    assert runs, "the scheduler created no runs for the nightly deployment"
    assert all(r["expected_start_time"][11:16] == "02:00" for r in runs), [r["expected_start_time"] for r in runs]
    assert runs[0]["parameters"]["source"] == "smoke"
    assert json.dumps(runs[0]["parameters"])  # parameters stored, no secrets among them
    assert "api_key" not in json.dumps(runs[0]["parameters"])


@pytest.mark.slow
def test_deploy_without_repo_path_defers_to_the_worker(prefect_server: dict[str, str], tmp_path: Path) -> None:
    """SANDFLOW_REPO unset at deploy time: the placeholder is stored, not the deploying cwd;
    a worker resolves it from its own environment, and fails loudly when it has none."""
    env = {k: v for k, v in prefect_server.items() if k != "SANDFLOW_REPO"}
    assert prefect(env, "work-pool", "create", "sandflow-process", "--type", "process").returncode == 0
    r = prefect(env, "--no-prompt", "deploy", "--name", "nightly")
    assert r.returncode == 0, r.stdout + r.stderr
    (dep,) = api(env, "/deployments/filter", {})
    step = dep["pull_steps"][0]
    assert step == {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $SANDFLOW_REPO }}"}}
    code = (
        "import asyncio, json, os, sys; from prefect.deployments.steps.core import run_step; "
        f"asyncio.run(run_step(json.loads({json.dumps(json.dumps(step))}))); print(os.getcwd())"
    )
    worker_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    ok = subprocess.run([sys.executable, "-c", code], env=dict(worker_env, SANDFLOW_REPO=str(tmp_path)),
                        cwd="/", capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1] == str(tmp_path), ok.stderr[-800:]
    bad = subprocess.run([sys.executable, "-c", code], env=worker_env, cwd="/", capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0, bad.stdout
