"""The embedded model for real: `sandflow run` with no endpoint starts SmolLM2 via llama.cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.local_model import LocalModelServer, find_gguf
from tasks.model import ModelClient, ModelConfig
from tasks.tools import TOOL_SCHEMAS

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_server_serves_tool_calls() -> None:
    assert find_gguf().suffix == ".gguf"
    with LocalModelServer() as server:
        cfg = ModelConfig(
            model=server.alias,
            base_url=server.base_url,
            max_tokens=64,
            request_timeout_s=300,
            temperature=0,
        )
        client = ModelClient(cfg)
        assert client.served_models() == [server.alias]
        reply = client.complete(
            [
                {"role": "system", "content": "You use tools."},
                {"role": "user", "content": "Call the submit tool now."},
            ],
            TOOL_SCHEMAS,
        )
        # Tiny model: we only require a well-formed reply that names a real tool, if any.
        assert reply.content or reply.tool_calls
        assert all(
            c.name in {"execute_bash", "str_replace_editor", "submit"} for c in reply.tool_calls
        )
        assert (
            reply.usage.prompt_tokens and reply.usage.prompt_tokens > 100
        )  # the tools were in the prompt
        proc = server.proc
    assert proc is not None and proc.poll() is not None  # stopped with the context


@pytest.mark.docker
def test_sandflow_run_end_to_end_with_embedded_model(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SANDFLOW_BASE_URL", "SANDFLOW_MODEL"))
    }
    cmd = [
        sys.executable,
        "-m",
        "sandflow.cli",
        "run",
        "-q",
        "Write the word hello to /testbed/output/answer.txt, then call submit.",
        "-o",
        str(tmp_path),
        "--max-steps",
        "2",
        "--request-timeout",
        "300",
        "--wall-clock",
        "900",
        "--max-tokens",
        "128",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.split()[0] in {"submitted", "max_steps", "context_exhausted"}, summary
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    traj = json.loads((run_dir / "trajectory.json").read_text())
    assert traj["metadata"]["model"] == "smollm2-135m-instruct"
    assert 1 <= len(traj["steps"]) <= 2
    kinds = [json.loads(x)["kind"] for x in (run_dir / "records.jsonl").read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "finish" and "turn" in kinds


def test_sandflow_serve_foreground_and_ctrl_c() -> None:
    import signal

    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "sandflow.cli", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "serving <alias> at <url> (log: ...); Ctrl+C stops"
        assert line.startswith("serving smollm2-135m-instruct at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        assert (
            httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
            == "smollm2-135m-instruct"
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/models", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_call_whose_client_left_stops_and_tokens_are_capped_by_the_server() -> None:
    """llama-cpp-python alone keeps generating for a client that timed out, and the retry
    waits behind it. The embedded server stops at the client's disconnect and caps
    max_tokens itself."""
    import time

    import httpx

    with LocalModelServer(max_tokens_cap=48) as server:
        url = f"{server.base_url}/chat/completions"
        endless = {
            "model": server.alias,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 1_000_000,  # asks for more than the cap
            "temperature": 0,
            "logit_bias": {"0": -100, "2": -100},  # no end-of-text: only a bound can stop it
        }
        reply = httpx.post(url, json=endless, timeout=300).json()
        assert reply["usage"]["completion_tokens"] == 48  # the server's cap, not the request's
        # With tools, llama-cpp-python generates the message or the arguments with no
        # max_tokens at all (up to n_ctx): the server's budget bounds them too.
        with_tools = dict(endless, max_tokens=32, tools=TOOL_SCHEMAS, tool_choice="auto")
        reply = httpx.post(url, json=with_tools, timeout=300).json()
        assert reply["usage"]["completion_tokens"] <= 32, reply["usage"]
        assert "client left" not in server.log_tail(4000)  # an answered call is not "cancelled"

    with LocalModelServer(max_tokens_cap=100_000) as server:
        url = f"{server.base_url}/chat/completions"
        endless["max_tokens"] = 100_000
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=endless, timeout=3)
        deadline = time.monotonic() + 120
        while "client left; generation stopped" not in server.log_tail(4000):
            assert time.monotonic() < deadline, server.log_tail(2000)
            time.sleep(0.2)
        # the server is free again: a short call is answered, not queued behind 100k tokens
        short = {
            "model": server.alias,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        }
        assert httpx.post(url, json=short, timeout=120).json()["usage"]["completion_tokens"] <= 4
