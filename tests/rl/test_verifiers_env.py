"""sandflow as a verifiers environment, driven by verifiers' own `vf-eval` (verifiers 0.4.0,
in a venv of its own: it pins openai < 3) against the scripted model over real HTTP: the
rollouts run in sandflow's sandboxes, land in the warehouse as one run, are scored by the
tasks' verifiers, and agree task by task with a sandflow run of the same tasks (the rollout
server, the same endpoint). A task set that cannot be scored is refused by vf-eval itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.flows.conftest import write_tasks
from tests.interop.conftest import tasks
from tests.rl.conftest import containers_of, new_run_id, read_episodes, rollout_server
from tests.scripted_model import ScriptedModel, text_reply, tool_reply
from tests.venvs import venv

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def vf_python() -> Path:
    """verifiers 0.4.0 (and uv, which runs its chat program) over sandflow's own packages."""
    return venv("verifiers")


def _user_text(body: dict) -> str:
    user = next((m.get("content") or "" for m in body.get("messages", []) if m.get("role") == "user"), "")
    if isinstance(user, list):
        user = " ".join(str(p.get("text") or "") for p in user if isinstance(p, dict))
    return str(user)


BAD_CALLS = [  # task t2 starts with calls a model gets wrong: an unknown tool, arguments
    tool_reply("rm_everything", {"path": "/"}),  # that are not JSON, a missing argument
    tool_reply("execute_bash", '{"command": '),
    tool_reply("str_replace_editor", {"command": "view"}),
]


def solver(body: dict, index: int) -> Any:
    """Write the answer (task t1's is wrong), submit, then say so (the harness asks once more)."""
    answer = "41" if "Task t1:" in _user_text(body) else "42"
    done = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
    if "Task t2:" in _user_text(body):
        if done < len(BAD_CALLS):
            return BAD_CALLS[done]
        done -= len(BAD_CALLS)
    if done == 0:
        return tool_reply("execute_bash", {"command": f"echo {answer} > /testbed/output/answer.txt"})
    if done == 1:
        return tool_reply("submit", {})
    return text_reply("done")


def vf_eval(py: Path, source: Path, wh: Path, run_id: str, url: str, out: Path, n: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{py.parent}:{os.environ.get('PATH', '')}", "DUMMY_KEY": "x"}
    return subprocess.run(
        [str(py.parent / "vf-eval"), "sandflow-env",
         "--env.taskset.source", str(source), "--env.taskset.warehouse", str(wh),
         "--env.taskset.run-id", run_id, "--env.agent.runtime.type", "subprocess",
         "--env.agent.harness.id", "null", "-n", str(n), "-r", "1", "-c", "3",
         "--model", "scripted", "--client.base-url", url, "--client.api-key-var", "DUMMY_KEY",
         "--no-push", "--rich", "None", "-o", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=out.parent,
    )  # fmt: skip


def test_vf_eval_runs_sandflow_tasks_into_the_warehouse_and_agrees_with_sandflow(
    vf_python: Path, tmp_path: Path
) -> None:
    source = write_tasks(tmp_path / "tiny.parquet", tasks(3))
    wh, out, run_id = tmp_path / "wh", tmp_path / "vf-out", new_run_id("vf")
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        r = vf_eval(vf_python, source, wh, run_id, model.url, out, 3)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        # every tool the model was offered is sandflow's, with sandflow's prompt
        offered = {t["function"]["name"] for body in model.requests for t in body.get("tools") or []}
        assert offered == {"execute_bash", "str_replace_editor", "submit"}
        first = model.requests[0]["messages"]
        assert first[0]["role"] == "system" and "/testbed" in first[0]["content"]

        [traces] = list(out.glob("*/traces.jsonl"))
        rewards = {}
        for line in traces.read_text().splitlines():
            t = json.loads(line)
            [trace] = t["traces"]
            assert t["ok"], trace.get("errors")
            rewards[t["task"]["data"]["id"]] = trace["rewards"]["sandflow_reward"]["score"]
            assert trace["metrics"]["submitted"] == 1.0
        assert rewards == {"t0": 1.0, "t1": 0.0, "t2": 1.0}
        # the bad calls were answered through verifiers' own path, one clear error each
        t2 = max((b for b in model.requests if "Task t2:" in _user_text(b)), key=lambda b: len(b["messages"]))
        errors = [str(m.get("content")) for m in t2["messages"] if m.get("role") == "tool"][:3]
        assert errors[0] == "error: unknown tool 'rm_everything'"
        assert errors[1].startswith("error: invalid JSON in tool arguments")
        assert "validation error for str_replace_editorArguments" in errors[2] and "path" in errors[2]

        eps = read_episodes(wh, run_id)  # one warehouse run, every rollout in it
        assert sorted(e["task_id"] for e in eps) == ["t0", "t1", "t2"]
        assert {e["termination"] for e in eps} == {"submitted"}
        # refused calls never reach the sandbox: t2's episode has its two good turns
        assert {e["task_id"]: e["num_turns"] for e in eps} == {"t0": 2, "t1": 2, "t2": 2}
        assert containers_of(run_id) == []
        from warehouse import Warehouse

        scores = {s["episode_id"]: s["score"] for s in Warehouse(wh).scores(run_id).to_pylist()}
        assert {e["task_id"]: scores[e["episode_id"]] for e in eps} == rewards

        # sandflow's own whole-episode run of the same tasks, same endpoint and sample 0
        from rl.client import RolloutClient

        with rollout_server(tmp_path / "wh-sandflow") as (srv_url, _), RolloutClient(srv_url) as client:
            result = client.rollouts(
                {"tasks": [t.canonical() for t in tasks(3)], "n": 1,
                 "endpoint": {"base_url": model.url, "model": "scripted"}}
            )  # fmt: skip
        assert {t["task_id"]: t["reward"] for t in result.ok} == rewards


def test_vf_eval_refuses_a_task_set_without_ground_truth(vf_python: Path, tmp_path: Path) -> None:
    from datasets_prep.task import Task

    bare = Task(id="no-truth", domain="instruct_follow", problem_statement="Write a haiku.", qa_type="instruction")
    source = write_tasks(tmp_path / "bare.parquet", [bare])
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        r = vf_eval(vf_python, source, tmp_path / "wh", new_run_id("vf-bad"), model.url, tmp_path / "out", 1)
        assert model.count == 0  # refused before any rollout
    assert r.returncode != 0
    assert "task 'no-truth' has no ground truth" in r.stdout + r.stderr


def test_a_rollout_that_ends_without_submit_leaves_no_sandbox(vf_python: Path, tmp_path: Path) -> None:
    """The model writes its answer, then stops calling tools (verifiers ends the rollout;
    sandflow never sees a submit): when vf-eval ends, the tool server closes the episode
    (recorded `interrupted`, its turn kept) and removes its sandbox; the reward is 0."""

    def stops(body: dict, index: int) -> Any:
        done = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        if done == 0:
            return tool_reply("execute_bash", {"command": "echo 42 > /testbed/output/answer.txt"})
        return text_reply("I am done.")

    source = write_tasks(tmp_path / "one.parquet", tasks(1))
    wh, out, run_id = tmp_path / "wh", tmp_path / "vf-out", new_run_id("vf-stop")
    with ScriptedModel(default=stops, models=("scripted",)) as model:
        r = vf_eval(vf_python, source, wh, run_id, model.url, out, 1)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    [traces] = list(out.glob("*/traces.jsonl"))
    [trace] = json.loads(traces.read_text().splitlines()[0])["traces"]
    assert trace["rewards"]["sandflow_reward"]["score"] == 0.0
    assert trace["metrics"]["submitted"] == 0.0
    assert containers_of(run_id) == []
    [ep] = read_episodes(wh, run_id)
    assert (ep["termination"], ep["num_turns"]) == ("interrupted", 1)


LOAD = r"""
import json
from rl.verifiers_env import load_environment
import verifiers.v1 as vf
env = load_environment("math", size=2, seed=3)
tasks = list(env.taskset)
print(json.dumps({"env": isinstance(env, vf.Env), "ids": [t.data.id for t in tasks],
                  "harness": env.config.agent.harness.id, "runtime": env.config.agent.runtime.type,
                  "run_id": env.taskset.config.run_id, "prompt": tasks[0].data.prompt_text[:2000]}))
"""


def test_load_environment_over_a_builtin_suite(vf_python: Path) -> None:
    """The Python entry point: a vf.Env over a suite, the same tasks `load_taskset` gives."""
    from datasets_prep.prepare import load_taskset

    r = subprocess.run([str(vf_python), "-c", LOAD], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    ts = load_taskset("math", size=2, seed=3)
    assert got["env"] and got["ids"] == [t.id for t in ts.tasks]
    assert (got["harness"], got["runtime"]) == ("null", "subprocess")
    assert got["run_id"].startswith("vf-")
    assert ts.tasks[0].problem_statement[:200] in got["prompt"]
