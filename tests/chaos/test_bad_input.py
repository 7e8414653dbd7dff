"""Bad input: a clear error before anything starts (issue #11 §4), through the real commands.

A careless user's data: file names that are not UTF-8 or carry control characters in a
`sandflow run -i` folder, text the Parquet writer cannot encode, a ground truth no
verifier can use, a 50 MB problem statement. Each must end with exit status 2 and one
message naming the row and field (or the file) and the limit — no traceback, no run
folder, no journal, no model call, no sandbox.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tests.chaos.conftest import SANDFLOW, bwrap_sandboxes_of, containers_of
from tests.scripted_model import ScriptedModel, tool_reply

pytestmark = [pytest.mark.chaos]

runner = CliRunner()


def sandflow(*args: str, **env: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env=env)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(params=["llm", "docker", "bwrap"])
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "docker":
        request.getfixturevalue("sandbox_image")
    if request.param == "bwrap":
        request.getfixturevalue("sandbox_rootfs")
    return str(request.param)


def _mode_args(mode: str) -> list[str]:
    return ["--mode", "llm"] if mode == "llm" else ["--backend", mode]


def _folder_with_bad_names(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "ok.txt").write_text("fine\n")
    for raw in (b"caf\xe9.txt", b"sub/new\nline.txt"):  # latin-1 byte; a newline in a name
        with open(os.path.join(os.fsencode(d), raw), "wb") as f:
            f.write(b"data\n")
    return d


# ----------------------------------------------------------- sandflow run: file names
def test_run_with_undecodable_and_control_file_names_fails_before_the_episode(
    scripted_model: ScriptedModel, tmp_path: Path, mode: str
) -> None:
    """Was: a traceback after the episode had started, and orphan journals."""
    scripted_model.push(tool_reply("submit", {}))
    out, wh = tmp_path / "runs", tmp_path / "wh"
    res = sandflow("run", "-q", "Read the files.", "-u", scripted_model.url, *_mode_args(mode),
                   "-i", str(_folder_with_bad_names(tmp_path)), "-o", str(out), "--warehouse", str(wh))
    text = flat(res.output)
    assert res.exit_code == 2, res.output
    assert "'caf\\xe9.txt': the file name is not valid UTF-8; rename it" in text, text
    assert "'sub/new\\x0aline.txt': the file name contains the control character U+000A" in text, text
    assert "nothing was started" in text and "Traceback" not in res.output
    assert scripted_model.requests == [] and not out.exists() and not wh.exists()


def test_run_with_a_bad_file_name_in_a_real_process_prints_no_traceback(tmp_path: Path) -> None:
    """The same through the installed `sandflow` binary: one message on stderr, exit 2."""
    with ScriptedModel([tool_reply("submit", {})], models=("scripted",)) as model:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDFLOW_")}
        proc = subprocess.run(
            [SANDFLOW, "run", "-q", "x", "-u", model.url, "--mode", "llm",
             "-i", str(_folder_with_bad_names(tmp_path)), "-o", str(tmp_path / "runs")],
            capture_output=True, env=env, timeout=120,
        )
        assert model.requests == []
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, (proc.stdout, err)
    assert err.startswith("Error: input folder") and "caf\\xe9.txt" in err and "Traceback" not in err
    assert proc.stdout == b"" and not (tmp_path / "runs").exists()


def test_run_with_a_fifo_in_the_folder_does_not_hang(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    d = tmp_path / "in"
    d.mkdir()
    os.mkfifo(d / "pipe")  # reading it would block forever
    res = sandflow("run", "-q", "x", "-u", scripted_model.url, "--mode", "llm", "-i", str(d),
                   "-o", str(tmp_path / "runs"))
    assert res.exit_code == 2 and "'pipe' is a fifo; only regular files can be copied" in flat(res.output)


def test_run_with_an_oversized_input_file_names_the_file_and_the_limit(
    scripted_model: ScriptedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDFLOW_MAX_FILE_BYTES", "1000")  # the application hands it to datasets_prep
    d = tmp_path / "in"
    d.mkdir()
    with open(d / "huge.bin", "wb") as f:
        f.truncate(5 * 1024**3)  # sparse: never read
    res = sandflow("run", "-q", "x", "-u", scripted_model.url, "--mode", "llm", "-i", str(d),
                   "-o", str(tmp_path / "runs"))
    assert res.exit_code == 2
    assert "'huge.bin' is 5.0 GB, over the limit of 1000 B per file (SANDFLOW_MAX_FILE_BYTES)" in flat(res.output)


# ---------------------------------------------------- tasks prepare: encoder errors
@pytest.mark.parametrize(
    "row, shown",
    [
        ({"ground_truth": "4\udcff"}, "row 1 (id 'b'): ground_truth: not valid UTF-8"),
        ({"input_files": {"\udcff.txt": "x"}}, "row 1 (id 'b'): input_files: file name '\\udcff.txt' is not valid UTF-8"),
        ({"metadata": {"source": "\ud800"}}, "row 1 (id 'b'): metadata: metadata['source']: not valid UTF-8"),
        ({"input_files": {"a.txt": "x\udcff"}}, "row 1 (id 'b'): input_files: input file 'a.txt' is not valid UTF-8"),
    ],
)
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_prepare_names_row_and_field_instead_of_an_encoder_error(
    tmp_path: Path, row: dict, shown: str, suffix: str
) -> None:
    """JSON's \\udcff escapes decode to lone surrogates: was pyarrow's/json's encoder error
    without a row or a field."""
    good = {"id": "a", "domain": "math", "problem_statement": "1+1?", "ground_truth": "2"}
    bad = {**good, "id": "b", **row}
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")  # ASCII file, \u escapes
    out = tmp_path / f"out{suffix}"
    res = sandflow("tasks", "prepare", str(src), "--out", str(out))
    assert res.exit_code == 2, res.output
    assert shown in flat(res.output), res.output
    assert "codec can't encode" not in res.output and not out.exists()


# ------------------------------------------------- a ground truth no verifier can use
def test_prepare_refuses_a_nested_dict_ground_truth_as_a_verifier_error(tmp_path: Path) -> None:
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"id": "n1", "domain": "general", "problem_statement": "Which?",
                               "ground_truth": {"answer": {"text": "B"}}}) + "\n")
    out = tmp_path / "out.parquet"
    res = sandflow("tasks", "prepare", str(src), "--out", str(out))
    assert res.exit_code == 2 and not out.exists()
    assert ("row 0 (id 'n1'): ground_truth: the 'open' verifier (picked for domain 'general') cannot use it"
            in flat(res.output)), res.output


def test_scoring_a_stored_task_with_an_unusable_ground_truth_raises_not_zero(tmp_path: Path) -> None:
    """A task set written by an earlier version holds a nested dict: reading it (show, score,
    flows) fails with the VerifierError; scoring a task that slipped through raises too."""
    from datasets_prep.io import read_taskset
    from datasets_prep.task import GroundTruthError, Task
    from datasets_prep.verifiers import VerifierError, score

    src = tmp_path / "old.jsonl"
    src.write_text(json.dumps({"id": "n1", "domain": "math", "problem_statement": "x?",
                               "ground_truth": {"a": {"b": 1}}}) + "\n")
    with pytest.raises(GroundTruthError, match="line 1 \\(id 'n1'\\): ground_truth: the 'math' verifier"):
        read_taskset(src)
    res = sandflow("tasks", "score", str(src), "--id", "n1", "--answer", "1")
    assert res.exit_code == 2 and "cannot use it" in flat(res.output) and "0.000" not in res.output
    slipped = Task.model_construct(id="n1", domain="math", problem_statement="x?", ground_truth={"a": {"b": 1}},
                                   input_files={}, qa_type=None, verifier="auto", metadata={})
    for answer in ("1", "", None):
        with pytest.raises(VerifierError):
            score(slipped, answer)


# ------------------------------------------------------ a 50 MB problem statement
def test_prepare_refuses_a_50_mb_problem_statement(tmp_path: Path) -> None:
    src = tmp_path / "big.jsonl"
    src.write_text(json.dumps({"id": "big", "domain": "math", "problem_statement": "x" * (50 * 1024 * 1024),
                               "ground_truth": "1"}) + "\n")
    out = tmp_path / "out.parquet"
    res = sandflow("tasks", "prepare", str(src), "--out", str(out))
    assert res.exit_code == 2 and not out.exists()
    assert ("row 0 (id 'big'): problem_statement: the text is 50.0 MB, over the limit of 4.0 MB per text "
            "field (SANDFLOW_MAX_TEXT_BYTES)") in flat(res.output), res.output


def test_the_text_limit_is_configurable_from_the_environment(tmp_path: Path) -> None:
    """In a real process: SANDFLOW_MAX_TEXT_BYTES lowers (or raises) the bound."""
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"id": "t", "domain": "math", "problem_statement": "y" * 2000,
                               "ground_truth": "1"}) + "\n")
    env = {**os.environ, "SANDFLOW_MAX_TEXT_BYTES": "1000"}
    proc = subprocess.run([SANDFLOW, "tasks", "prepare", str(src), "--out", str(tmp_path / "o.jsonl")],
                          capture_output=True, env=env, timeout=120)
    text = flat(proc.stdout.decode())
    assert proc.returncode == 2 and "over the limit of 1000 B per text field (SANDFLOW_MAX_TEXT_BYTES)" in text
    env["SANDFLOW_MAX_TEXT_BYTES"] = "lots"
    proc = subprocess.run([SANDFLOW, "tasks", "prepare", str(src), "--out", str(tmp_path / "o.jsonl")],
                          capture_output=True, env=env, timeout=120)
    err = flat(proc.stderr.decode())
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "invalid setting max_text_bytes (SANDFLOW_MAX_TEXT_BYTES or sandflow.toml): 'lots' is not valid" in err, err


def test_run_episode_refuses_a_constructed_50_mb_statement_before_any_sandbox(
    tmp_path: Path, test_run_id: str, mode: str
) -> None:
    from datasets_prep.task import Task, TaskValidationError
    from sandbox.base import SandboxConfig
    from tasks.loop import run_episode
    from tasks.model import ModelConfig
    from warehouse.writer import EpisodeWriter

    run_id = f"{test_run_id}-big-{mode}"
    task = Task.model_construct(id="big", domain="general", problem_statement="z" * (50 * 1024 * 1024),
                                ground_truth="x", input_files={}, qa_type="exact", verifier="auto", metadata={})
    with ScriptedModel([tool_reply("submit", {})], models=("scripted",)) as model, \
            EpisodeWriter(tmp_path / "wh", durability="flush") as writer:
        with pytest.raises(TaskValidationError, match="task 'big': problem_statement: the text is 50.0 MB"):
            run_episode(task, ModelConfig(model="scripted", base_url=model.url),
                        SandboxConfig(backend="docker" if mode == "llm" else mode, run_id=run_id), writer,
                        run_id=run_id, mode="llm" if mode == "llm" else "sandbox")
        assert model.requests == []
    assert containers_of(run_id) == [] and bwrap_sandboxes_of(run_id) == []
    assert not any(p.is_file() for p in (tmp_path / "wh").rglob("*"))  # no journal, no episode


# ------------------------------------- issue #22 item 7: a file name that names no file
@pytest.mark.parametrize("name", [".", "./", "a/./b.txt", "docs//b.txt", "./notes.txt", "..", "", "a\x00b"])
def test_prepare_refuses_a_file_name_that_names_no_file(tmp_path: Path, name: str) -> None:
    """'.' passed `tasks prepare`, then every episode failed placing it (Is a directory)
    and `flows run` exited 0. Now the row is refused: exit 2, the row, id and name."""
    good = {"id": "a", "domain": "math", "problem_statement": "1+1?", "ground_truth": "2"}
    bad = {**good, "id": "b", "input_files": {name: "data"}}
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    out = tmp_path / "out.parquet"
    res = sandflow("tasks", "prepare", str(src), "--out", str(out))
    assert res.exit_code == 2, res.output
    assert "row 1 (id 'b'): input_files: file name" in flat(res.output), res.output
    assert "Traceback" not in res.output and not out.exists()
