"""`--task-runner ray`: a run's episodes as Prefect tasks on a local Ray instance (the
optional extra `ray`: prefect-ray), for real: Docker sandboxes, the scripted model, the
warehouse. verl and LLM-in-Sandbox-RL train on Ray; this is the same runner they use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.flows.conftest import benchmark_on, needs, worker_pids
from tests.scripted_model import ScriptedModel

LONG = "t" * 70  # a cluster's TMPDIR (/scratch/slurm/job-123456/...): Ray's sockets under
# it pass the 107 bytes of a unix socket's path


@pytest.mark.slow
@pytest.mark.parametrize("tmpdir", ["default", "long"])
@pytest.mark.usefixtures("prefect_harness", "docker_image")
def test_ray_runs_a_benchmark_in_its_worker_processes(
    tmp_path: Path, model: ScriptedModel, monkeypatch: pytest.MonkeyPatch, tmpdir: str
) -> None:
    """Under a long TMPDIR too: the run hands Ray a short temp dir (flows/run.py)."""
    needs("prefect_ray", "the optional extra `ray` (prefect-ray): bash scripts/setup.sh --ray")
    if tmpdir == "long":
        (tmp_path / LONG).mkdir()
        monkeypatch.delenv("RAY_TMPDIR", raising=False)
        monkeypatch.setenv("TMPDIR", str(tmp_path / LONG))
    _, output = benchmark_on(["--concurrency", "2", "--task-runner", "ray"], tmp_path, model)
    ran_in = worker_pids(output)  # the episodes ran in Ray's worker processes, not in this one
    assert ran_in and os.getpid() not in ran_in
    import ray

    assert not ray.is_initialized()  # the run's Ray instance ended with it


@pytest.mark.parametrize(
    ("runner", "hidden", "says"),
    [("nope", None, "--task-runner 'nope': use 'thread', 'dask' or 'ray'"),
     ("ray", "prefect_ray", "--task-runner ray needs Prefect's Ray task runner, an optional extra")],
)  # fmt: skip
def test_a_task_runner_that_cannot_run_is_one_sentence_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner: str, hidden: str | None, says: str
) -> None:
    """An unknown runner, or `ray` without the extra installed: exit 2, one sentence naming
    it (and how to install), no warehouse written."""
    import sys

    from typer.testing import CliRunner

    from sandflow.cli import app

    if hidden:
        monkeypatch.setitem(sys.modules, hidden, None)  # `import prefect_ray` raises ImportError
    wh = tmp_path / "wh"
    res = CliRunner(env={"COLUMNS": "300"}).invoke(
        app,
        ["flows", "run", "smoke", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
         "--warehouse", str(wh), "--task-runner", runner],
    )  # fmt: skip
    assert res.exit_code == 2, res.output + repr(res.exception)
    assert says in res.output and "Traceback" not in res.output, res.output
    assert not wh.exists()


def test_a_long_tmpdir_gets_ray_a_short_temp_dir_of_this_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's default (TMPDIR/ray) when its sockets fit; else a short folder of our own."""
    import stat

    from flows.run import RAY_SOCKET_TAIL, ray_temp_dir

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", "/tmp")
    assert ray_temp_dir() is None
    monkeypatch.setenv("TMPDIR", str(tmp_path / LONG))
    short = ray_temp_dir()
    assert short is not None and len(short) + RAY_SOCKET_TAIL <= 107
    st = os.lstat(short)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
    assert ray_temp_dir() == short  # the same one each run: Ray keeps its logs there
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / LONG))  # Ray reads it first
    monkeypatch.setenv("TMPDIR", "/tmp")
    assert ray_temp_dir() == short
