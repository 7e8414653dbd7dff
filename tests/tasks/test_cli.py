"""`sandflow run` through typer's CliRunner: clear one-sentence errors, saved run folders."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tasks.local_model import free_port
from tests.scripted_model import ScriptedModel, text_reply, tool_reply

runner = CliRunner()


def invoke(args: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(app, args, env=env or {})


def flat(text: str) -> str:
    """Output without rich's box drawing and line wrapping."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def run_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def test_bad_flag_is_one_clear_sentence(tmp_path: Path) -> None:
    res = invoke(["run", "--query", "x", "--max-steps", "0", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "Invalid value for '--max-steps': Input should be greater than or equal to 1" in flat(res.output)
    res = invoke(["run", "--query", "x", "--mode", "chat"])
    assert res.exit_code == 2 and "'chat' is not one of 'sandbox', 'llm'" in flat(res.output)
    res = invoke(["run", "--query", "x", "--domain", "poetry"])
    assert res.exit_code == 2 and res.output.startswith("Error: unknown --domain 'poetry': use one of general, biomed")
    res = invoke(["run", "--query", "x", "--extra-body", "{top_k: 2}"])
    assert res.exit_code == 2 and res.output.startswith("Error: --extra-body is not valid JSON")
    res = invoke(["run", "--query", "x", "--input-dir", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "does not exist" in flat(res.output)


def test_unreachable_endpoint(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    res = invoke(["run", "-q", "x", "--base-url", url, "--mode", "llm", "-o", str(tmp_path)])
    assert res.exit_code == 2
    assert res.output.strip() == f"Error: cannot reach the model server at {url}: it does not answer (is it running? check --base-url)"


def test_model_not_served(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    res = invoke(["run", "-q", "x", "-u", scripted_model.url, "-m", "gpt-9", "--mode", "llm", "-o", str(tmp_path)])
    assert res.exit_code == 2
    assert "does not serve model 'gpt-9'; it serves: scripted" in res.output
    assert scripted_model.requests == []  # stopped before any chat request


def test_llm_mode_run_saves_folder_and_keeps_key_out(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    secret = "sk-test-cli-SECRET-99"
    scripted_model.push(text_reply("2+2=4. Final answer: 4"))
    res = invoke(["run", "-q", "What is 2+2?", "-u", scripted_model.url, "--mode", "llm", "-o", str(tmp_path),
                  "--extra-body", '{"top_k": 20}', "--temperature", "0.1"],
                 env={"SANDFLOW_API_KEY": secret})
    assert res.exit_code == 0, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("submitted after 1 turn(s)") and "answer: 4;" in last
    (run_dir,) = run_dirs(tmp_path)
    traj = json.loads((run_dir / "trajectory.json").read_text())
    assert traj["problem_statement"] == "What is 2+2?" and traj["metadata"]["answer"] == "4"
    assert (run_dir / "files" / "answer.txt").read_text() == "4\n"
    assert scripted_model.headers[-1]["authorization"] == f"Bearer {secret}"
    assert scripted_model.requests[-1]["top_k"] == 20 and scripted_model.requests[-1]["temperature"] == 0.1
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert secret not in f.read_text(errors="replace"), f
    assert secret not in res.output


@pytest.mark.docker
def test_sandbox_run_with_input_dir(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "numbers.txt").write_text("1 2 3 4\n")
    scripted_model.push(
        tool_reply("execute_bash", {"command": "python3 -c \"print(sum(map(int, open('/testbed/documents/numbers.txt').read().split())))\" > /testbed/output/answer.txt"}, content="Summing."),
        tool_reply("submit", {}),
    )
    out = tmp_path / "runs"
    res = invoke(["run", "-q", "Sum the numbers in numbers.txt", "-u", scripted_model.url,
                  "--input-dir", str(inputs), "-o", str(out), "--max-steps", "5"])
    assert res.exit_code == 0, res.output
    assert "action: execute_bash" in res.output and "Summing." in res.output
    assert "answer: 10;" in res.output.strip().splitlines()[-1]
    (run_dir,) = run_dirs(out)
    assert (run_dir / "files" / "answer.txt").read_text() == "10\n"
    kinds = [json.loads(line)["kind"] for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert kinds == ["start", "turn", "turn", "finish"]


@pytest.mark.docker
def test_missing_image_is_a_sandbox_error_in_one_sentence(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    res = invoke(["run", "-q", "x", "-u", scripted_model.url, "--image", "nope/none:1", "-o", str(tmp_path), "--quiet"])
    assert res.exit_code == 3
    first, last = res.output.strip().splitlines()
    assert first.startswith("sandbox_error: could not open the sandbox: The sandbox image nope/none:1 is not on the engine")
    assert last.startswith("sandbox_error after 0 turn(s)")
    assert scripted_model.requests == []


def test_run_into_the_warehouse(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    from warehouse import Warehouse

    scripted_model.push(text_reply("Final answer: 4"))
    wh_dir = tmp_path / "wh"
    res = invoke(["run", "-q", "2+2?", "-u", scripted_model.url, "--mode", "llm", "-o", str(tmp_path / "runs"),
                  "--warehouse", str(wh_dir), "--quiet"])
    assert res.exit_code == 0, res.output
    wh = Warehouse(wh_dir)
    episodes = wh.episodes().to_pylist()
    assert len(episodes) == 1 and episodes[0]["answer"] == "4" and episodes[0]["termination"] == "submitted"
    assert wh.turns(episodes[0]["run_id"]).num_rows == 1
    assert wh.run_info(episodes[0]["run_id"])["status"] == "finished"
    # the run names the hash of the task it ran: `sandflow compare` never pairs it blindly
    assert len(wh.run_info(episodes[0]["run_id"])["dataset_hash"] or "") == 64
