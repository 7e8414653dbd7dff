"""Fixtures of the interop tests: one real run (Prefect, Docker, DuckDB, the scripted model
with exact token ids and logprobs, both modes, scored) that every export test reads back,
and the consumer packages' venvs where they cannot live in .venv.

The run's model, per sandbox episode: looks at the input, writes the answer, makes one
call with arguments that are not JSON (a model does that), views the answer, submits;
it thinks aloud (reasoning) on the first turn. Task t1's answer is wrong (41), so the
scores are not all equal. LLM mode: one reply.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import flows  # noqa: F401  (Prefect settings before prefect is imported)
from tests.flows.conftest import new_run_id, run_kwargs, write_tasks
from tests.scripted_model import Reply, ScriptedModel, ToyTokenizer, text_reply, tool_reply
from tests.venvs import venv

REPO = Path(__file__).resolve().parents[2]


def tasks(n: int = 3) -> list[Any]:
    from datasets_prep.task import Task

    return [
        Task(
            id=f"t{i}",
            domain="math",
            problem_statement=f"Task t{i}: what is 6 * 7? Write only the number.",
            ground_truth="42",
            qa_type="exact",
            verifier="exact",
            input_files={"notes.txt": f"note {i}\n"} if i == 0 else {},
        )
        for i in range(n)
    ]


def answer_of(body: dict) -> str:
    user = next((m.get("content") or "" for m in body.get("messages", []) if m.get("role") == "user"), "")
    return "41" if "Task t1:" in user else "42"


def solver(body: dict, index: int) -> Reply:
    answer = answer_of(body)
    if not body.get("tools"):
        return text_reply(answer)
    done = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
    if done == 0:
        return tool_reply(
            "execute_bash",
            {"command": "ls /testbed/documents; cat /testbed/documents/notes.txt || true"},
            reasoning_content="First look at the input files.",
        )
    if done == 1:
        return tool_reply("execute_bash", {"command": f"echo {answer} > /testbed/output/answer.txt"})
    if done == 2:
        return tool_reply("str_replace_editor", '{"command": "view", "path": ')  # not JSON
    if done == 3:
        return tool_reply("str_replace_editor", {"command": "view", "path": "/testbed/output/answer.txt"})
    return tool_reply("submit", {})


@dataclass
class RealRun:
    warehouse: Path
    run_id: str
    task_set: Path
    tmp: Path


@pytest.fixture(scope="session")
def real_run(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> RealRun:
    """One run of 3 tasks x both modes, recorded with token ids and logprobs, then scored."""
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.run import run_flow
    from flows.score import score_flow
    from sandbox.image import DEFAULT_SPEC

    try:
        import docker

        docker.from_env(timeout=20).images.get(DEFAULT_SPEC.tag)
    except Exception as exc:
        pytest.fail(f"sandbox image {DEFAULT_SPEC.tag} unavailable ({exc}): run `sandflow image build`")
    tmp = tmp_path_factory.mktemp("interop-run")
    ts = write_tasks(tmp / "tiny.parquet", tasks(), name="tiny")
    wh = tmp / "wh"
    rid = new_run_id("interop")
    with ScriptedModel(default=solver, models=("scripted",), tokenizer=ToyTokenizer()) as server:
        out = run_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=2))(
            **run_kwargs(ts, server, wh, run_id=rid, logprobs=True, return_token_ids=True, max_steps=8)
        )
    assert out["succeeded"] == 6, out
    score_flow(run_id=rid, warehouse=str(wh))
    return RealRun(wh, rid, ts, tmp)


@pytest.fixture(scope="session")
def run_data(real_run: RealRun) -> Any:
    """The run as the warehouse hands it to analysis/ (the reference every export is checked against)."""
    from warehouse import Warehouse

    return Warehouse(real_run.warehouse).load_run(real_run.run_id)


@pytest.fixture(scope="session")
def harbor_python() -> Iterator[Path]:
    """A venv with the harbor package (its ATIF models and validator, `harbor run`) and
    Docker Compose (bin/docker-compose), created once."""
    yield venv("harbor")  # tests/venvs.py (built by scripts/setup.sh --test)


def harbor_check(py: Path, folder: Path) -> dict[str, Any]:
    """Validate every trajectory in `folder` with harbor's own validator and models; return
    what harbor read: per file, its steps, tool calls, observations and metrics."""
    script = r"""
import json, sys, typing
from pathlib import Path
from harbor.models.trajectories import Trajectory
from harbor.utils.trajectory_validator import TrajectoryValidator
out = {"newest": typing.get_args(Trajectory.model_fields["schema_version"].annotation)[-1], "files": {}}
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    v = TrajectoryValidator()
    valid = v.validate(str(f))
    t = Trajectory.model_validate_json(f.read_text())
    out["files"][f.name] = {
        "valid": valid, "errors": v.get_errors()[:5], "version": t.schema_version,
        "trajectory_id": t.trajectory_id,
        "steps": [{"source": s.source, "message": s.message if isinstance(s.message, str) else None,
                   "calls": [[c.tool_call_id, c.function_name, c.arguments] for c in (s.tool_calls or [])],
                   "results": [[r.source_call_id, r.content] for r in (s.observation.results if s.observation else [])],
                   "metrics": s.metrics.model_dump() if s.metrics else None} for s in t.steps],
        "final": t.final_metrics.model_dump() if t.final_metrics else None,
    }
print(json.dumps(out))
"""
    r = subprocess.run([str(py), "-c", script, str(folder)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def run_cli(*args: str) -> Any:
    from typer.testing import CliRunner

    from sandflow.cli import app

    return CliRunner(env={"COLUMNS": "300"}).invoke(app, list(args))


# ------------------------------------------------------------------ hand-made peer folders
def peer_folder(root: Path, problems: dict[str, Any], *, mode: str = "llm-in-sandbox", stamp: str = "20261126_025517") -> Path:
    """A folder in llm-in-sandbox 0.2.0's output format (results.json, trajectory.json, logs/)."""
    folder = root / f"{stamp}_math_openai_scripted_LLMinSandbox"
    (folder / "logs").mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"config": {"mode": mode, "llm_name": "openai/x", "max_steps": 6}, "task": "math", "total": len(problems)}))
    (folder / "trajectory.json").write_text(json.dumps(problems))
    return folder


def peer_problem(answer: str = "42", reward: Any = 1.0) -> dict[str, Any]:
    step = {"thought": "", "reasoning_content": "", "action": {"function": "submit", "parameters": {}}, "observation": "<<< Finished >>>", "metadata": {"step": 1, "exec_time": 0.1}}
    return {"problem_statement": "What is 6*7?", "trajectory": [step], "reward": reward, "agent_answer": answer, "ground_truth": "42"}
