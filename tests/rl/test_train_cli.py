"""`sandflow train`'s bad input: one sentence naming the folder, task or file, exit 2, before
any model or sandbox is loaded (the real CLI in a subprocess; no torch needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from datasets_prep.io import write_taskset
from datasets_prep.task import Task, TaskSet


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandflow.cli", "train", "--warehouse", str(tmp_path / "wh"),
         "--output", str(tmp_path / "out"), *args],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )


def _one_sentence(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp := Path(proc.args[5])).exists() or not any(tmp.rglob("*.parquet"))  # nothing recorded


def test_a_policy_folder_without_weights(tmp_path: Path) -> None:
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _one_sentence(_train(tmp_path, "--policy", str(folder)), str(folder), "no weights")
    _one_sentence(_train(tmp_path, "--policy", str(tmp_path / "nowhere")), "does not exist")


def test_a_task_set_whose_task_has_no_usable_verifier(tmp_path: Path) -> None:
    ts = TaskSet(name="t", tasks=[
        Task(id="fine", domain="math", problem_statement="1+1?", ground_truth="2", verifier="exact"),
        Task(id="judged", domain="general", problem_statement="Write a poem.", ground_truth="a poem",
             verifier="judge"),
    ])
    path = write_taskset(ts, tmp_path / "tasks.jsonl")
    _one_sentence(_train(tmp_path, "--tasks", str(path)), "judged", "verifier")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        r.pop("ground_truth", None)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _one_sentence(_train(tmp_path, "--tasks", str(path)), "ground_truth")


def test_a_checkpoint_of_another_policy(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "sandflow_policy.json").write_text(json.dumps({"policy": "/models/other", "training_run": "x"}))
    _one_sentence(_train(tmp_path, "--resume", str(ckpt)), str(ckpt), "/models/other")
    plain = tmp_path / "plain"
    plain.mkdir()
    _one_sentence(_train(tmp_path, "--resume", str(plain)), "not a sandflow training checkpoint")


def test_a_table_whose_mapping_names_a_missing_column(tmp_path: Path) -> None:
    table = tmp_path / "qa.csv"
    table.write_text("q,a\nWhat is 2+2?,4\n")
    proc = _train(tmp_path, "--tasks", str(table), "--mapping", "question=question_text,answer=a")
    _one_sentence(proc, "question_text")


@pytest.mark.parametrize("args, words", [
    (["--tasks", "no-such-suite"], ["no-such-suite"]),
    (["--prompts-per-step", "50", "--tasks", "smoke"], ["--prompts-per-step 50"]),
    (["--prompts", "/nowhere"], ["general.yaml"]),
    (["--vllm"], ["--gpu"]),
    (["--evaluate", "/nowhere/heldout.parquet"], ["--evaluate /nowhere/heldout.parquet", "does not exist"]),
    (["--evaluate", "smoke", "--evaluate-mode", "sideways"], ["--evaluate-mode 'sideways'"]),
])
def test_other_bad_input(tmp_path: Path, args: list[str], words: list[str]) -> None:
    _one_sentence(_train(tmp_path, *args), *words)


def test_the_report_holds_every_step_and_its_curve(tmp_path: Path) -> None:
    from rl.train import StepRow, write_report

    rows = [StepRow("run-a", i, f"run-a@{i - 1}", 0.1 * i, None, 2.0, 1e-5, 0.25 * i, 0.1, 900,
                    8, i - 1, 100.0, 30.0, 2.0, 1.0, 67.0, 0.03) for i in (1, 2, 3)]
    report = write_report(rows, tmp_path / "out", "run-a")
    text = report.read_text()
    assert "![training curve](training_curve.png)" in text
    assert [ln.split("|")[1].strip() for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()] == ["1", "2", "3"]
    png = (tmp_path / "out" / "training_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
