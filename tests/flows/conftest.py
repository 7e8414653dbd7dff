"""Fixtures of the pipeline tests: a tiny task set, a scripted model that solves it, the
real Docker engine and image, and a check that no container outlives a test."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_RUN_PREFIX
from tests.scripted_model import Reply, ScriptedModel, text_reply, tool_reply

ANSWER = "42"


def new_run_id(tag: str) -> str:
    return f"{TEST_RUN_PREFIX}flows-{tag}-{uuid.uuid4().hex[:6]}"


def tiny_tasks(n: int = 3) -> list[Any]:
    from datasets_prep.task import Task

    tasks = [
        Task(
            id=f"t{i}",
            domain="math",
            problem_statement=f"Task t{i}: what is 6 * 7? Write only the number.",
            ground_truth=ANSWER,
            qa_type="exact",
            verifier="exact",
            input_files={"notes.txt": f"note {i}\n"} if i == 0 else {},
        )
        for i in range(n)
    ]
    return tasks


def write_tasks(path: Path, tasks: list[Any], name: str = "tiny") -> Path:
    from datasets_prep.io import write_taskset
    from datasets_prep.task import TaskSet

    return write_taskset(TaskSet.build(tasks, name=name, source="tests/flows"), path)


def solver(body: dict, index: int) -> Reply:
    """Sandbox mode: look at the input, compute, write the answer, submit. LLM mode: answer."""
    if not body.get("tools"):
        return text_reply(ANSWER)
    done = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
    steps = [
        ("execute_bash", {"command": "ls /testbed/documents; cat /testbed/documents/notes.txt || true"}),
        ("execute_bash", {"command": "python3 -c 'print(6*7)' > /testbed/output/answer.txt"}),
        ("str_replace_editor", {"command": "view", "path": "/testbed/output/answer.txt"}),
        ("submit", {}),
    ]
    name, args = steps[min(done, len(steps) - 1)]
    return tool_reply(name, args)


def needs(module: str, how: str) -> None:
    """An optional part (an extra, a service the set-up starts when asked): in CI (CI=true,
    where .ci/run asks for every part) its absence fails the test; elsewhere it is skipped
    with the reason and how to get it, shown in pytest's summary."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        message = f"needs {how}"
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def benchmark_on(runner_args: list[str], tmp_path: Path, model: ScriptedModel) -> tuple[str, str]:
    """`sandflow flows run` of 2 tiny tasks in both modes with `runner_args` (a task runner);
    checks every episode submitted and no container left; (run id, the command's output)."""
    from typer.testing import CliRunner

    from sandflow.cli import app
    from warehouse.query import connect

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(2))
    wh = tmp_path / "wh"
    res = CliRunner(env={"COLUMNS": "300"}).invoke(
        app,
        ["flows", "run", str(ts), "--base-url", model.url, "--model", "scripted", "--warehouse", str(wh),
         "--mode", "both", "--max-steps", "6", *runner_args],
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
    assert containers_of(rid) == []
    return rid, res.output


def worker_pids(output: str) -> set[int]:
    """The pids `flows run` names as where its episodes ran (Dask, Ray)."""
    return {int(p) for p in re.findall(r"worker pids \[([\d, ]+)\]", output)[0].split(", ")}


@pytest.fixture
def model() -> Iterator[ScriptedModel]:
    with ScriptedModel(default=solver, models=("scripted",)) as server:
        yield server


@pytest.fixture(scope="session")
def docker_image() -> str:
    import docker

    from sandbox.image import DEFAULT_SPEC

    try:
        docker.from_env(timeout=20).images.get(DEFAULT_SPEC.tag)
    except Exception as exc:  # the suite needs the real engine and image
        pytest.fail(f"sandbox image {DEFAULT_SPEC.tag} unavailable ({exc}): run `sandflow image build`")
    return DEFAULT_SPEC.tag


def containers_of(run_id: str) -> list[Any]:
    import docker

    return docker.from_env().containers.list(ignore_removed=True, all=True, filters={"label": f"sandflow.run_id={run_id}"})


def run_kwargs(task_set: Path, server: ScriptedModel, warehouse: Path, **kw: Any) -> dict[str, Any]:
    """run_flow's arguments: one RunSpec (tasks/spec.py) from these flat fields."""
    from tasks.spec import RunSpec

    base: dict[str, Any] = dict(
        task_set=str(task_set),
        model="scripted",
        base_url=server.url,
        mode="both",
        concurrency=2,
        max_steps=6,
        warehouse=str(warehouse),
        wall_clock_s=120.0,
        durability="flush",
    )
    base.update(kw)
    return {"spec": RunSpec(**base)}
