"""`sandflow rl openenv` driven by openenv-core's own client (GenericEnvClient, over its
WebSocket protocol), both in openenv-core 0.3.0's venv (it pulls gradio, which would
downgrade the shared venv's pillow): a whole episode to the verifier's reward, bad actions
refused through OpenEnv's error path, and a client that goes away leaves no sandbox."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.flows.conftest import write_tasks
from tests.interop.conftest import tasks
from tests.rl.conftest import containers_of, new_run_id, read_episodes
from tests.venvs import venv

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CLIENT = r"""
import asyncio, json, os, sys
from openenv import GenericEnvClient

async def main(url):
    out = {"bad": []}
    async with GenericEnvClient(base_url=url) as c:
        r = await c.reset(task_id="t0")
        obs = r.observation
        out["reset"] = {"roles": [m["role"] for m in obs["messages"]], "done": r.done, "reward": r.reward,
                        "tools": sorted(t["function"]["name"] for t in obs["tools"])}
        r = await c.step({"tool": "execute_bash", "arguments": {"command": "echo 42 > /testbed/output/answer.txt; echo wrote"}})
        out["step"] = {"done": r.done, "reward": r.reward, "content": r.observation["messages"][0]["content"]}
        for bad in ({"tool": "rm_everything"}, {"tool": "execute_bash", "arguments": "{not json"},
                    {"tool": "execute_bash", "arguments": "[1, 2]"}):
            try:
                await c.step(bad)
                out["bad"].append(None)
            except Exception as e:
                out["bad"].append(f"{type(e).__name__}: {e}")
        r = await c.step({"tool": "submit"})
        out["submit"] = {"done": r.done, "reward": r.reward, "termination": r.observation["termination"],
                         "verifier": r.observation["verifier"], "episode_id": r.observation["episode_id"]}
        try:
            await c.reset(task_id="no-such-task")
        except Exception as e:
            out["bad_task"] = f"{type(e).__name__}: {e}"
    c = GenericEnvClient(base_url=url)  # this one goes away mid-episode, without closing
    await c.connect()
    r = await c.reset(task_id="t1")
    out["left"] = r.observation["episode_id"]
    await c.step({"tool": "execute_bash", "arguments": {"command": "echo 41 > /testbed/output/answer.txt"}})
    print(json.dumps(out), flush=True)
    os._exit(0)  # the process dies: its socket is closed by the kernel, no close message

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def oe_python() -> Path:
    return venv("openenv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_openenv_client_drives_an_episode_and_a_lost_client_leaves_no_sandbox(
    oe_python: Path, tmp_path: Path
) -> None:
    source = write_tasks(tmp_path / "tiny.parquet", tasks(3))
    wh, run_id, port = tmp_path / "wh", new_run_id("openenv"), _free_port()
    cmd = [str(oe_python), "-c", "import sys; from sandflow.cli import main; sys.argv[0] = 'sandflow'; main()",
           "rl", "openenv", "--tasks", str(source), "-w", str(wh), "--run-id", run_id, "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = subprocess.run([str(oe_python), "-c", CLIENT, url], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["reset"] == {"roles": ["system", "user"], "done": False, "reward": None,
                                "tools": ["execute_bash", "str_replace_editor", "submit"]}  # fmt: skip
        assert out["step"]["done"] is False and "wrote" in out["step"]["content"]
        unknown, not_json, not_object = out["bad"]
        assert "Server error: unknown tool 'rm_everything'" in unknown
        assert "action.arguments is not valid JSON" in not_json
        assert "action.arguments must be a JSON object, got list" in not_object
        assert out["submit"]["done"] is True and out["submit"]["reward"] == 1.0
        assert out["submit"]["termination"] == "submitted"
        assert "no task 'no-such-task' in the server's task set" in out["bad_task"]

        # the client that vanished: its session is closed, its sandbox removed, its episode kept
        deadline = time.monotonic() + 60
        while containers_of(run_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert containers_of(run_id) == []
        eps = {e["episode_id"]: e for e in read_episodes(wh, run_id)}
        assert eps[out["submit"]["episode_id"]]["termination"] == "submitted"
        assert eps[out["left"]]["termination"] == "interrupted"
        assert eps[out["left"]]["num_turns"] == 1
    finally:
        server.terminate()
        server.wait(30)
    assert containers_of(run_id) == []


def test_openenv_server_refuses_a_task_set_without_ground_truth(oe_python: Path, tmp_path: Path) -> None:
    from datasets_prep.task import Task

    bare = Task(id="no-truth", domain="instruct_follow", problem_statement="Write a haiku.", qa_type="instruction")
    source = write_tasks(tmp_path / "bare.parquet", [bare])
    cmd = [str(oe_python), "-c", "import sys; from sandflow.cli import main; sys.argv[0] = 'sandflow'; main()",
           "rl", "openenv", "--tasks", str(source), "-w", str(tmp_path / "wh"), "--port", str(_free_port())]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 2
    assert "task 'no-truth' has no ground truth" in r.stdout + r.stderr


def test_without_openenv_core_the_command_says_how_to_install_it(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("openenv") is not None:
        pytest.skip("openenv-core is installed in this venv")
    from tests.interop.conftest import run_cli

    r = run_cli("rl", "openenv", "--tasks", str(tmp_path / "any.parquet"))
    assert r.exit_code == 2
    assert "sandflow rl openenv needs openenv-core" in r.output and "sandflow[openenv]" in r.output
