"""Host files and secrets through the data (issue #11 §2), through the real commands.

The attacks: a table whose context_path column names `..` paths, absolute paths,
/proc/self/environ, and symlinks out of the table's folder; a `sandflow run -i` folder
holding symlinks to /etc/passwd and /proc/self/environ; a document or input file that
holds the API key. Each must be refused with a message naming the row/field/path (or
the file), and nothing from outside — above all no key — may reach the task file, the
sandbox, the trajectory, the journal or the warehouse. Symlinks that stay inside the
input folder are content: they reach the sandbox as regular files, on both backends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tests.chaos.conftest import bwrap_sandboxes_of, containers_of
from tests.scripted_model import ScriptedModel, text_reply, tool_reply

pytestmark = [pytest.mark.chaos]

KEY = "sk-issue11-chaos-REAL-KEY-9f8e7d6c5b4a"
PASSWD_LINE = "root:x:0:0:"
runner = CliRunner()


def sandflow(*args: str, **env: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env={"OPENAI_API_KEY": KEY, **env})


def flat(text: str) -> str:
    return " ".join(text.split())


def everything_under(root: Path) -> str:
    """All bytes of all files under `root` (to prove a secret is nowhere in them)."""
    if not root.exists():
        return ""
    return "".join(p.read_bytes().decode("utf-8", "replace") for p in root.rglob("*") if p.is_file())


@pytest.fixture(params=["docker", "bwrap"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue("sandbox_image" if request.param == "docker" else "sandbox_rootfs")
    return str(request.param)


# ------------------------------------------------------- tasks prepare: context_path
@pytest.mark.parametrize(
    "path_value, says",
    [
        ("../secret.txt", "contains '..'"),
        ("/proc/self/environ", "is an absolute path"),
        ("/etc/passwd", "is an absolute path"),
        ("docs/leak", "leads to"),  # docs/leak -> ../../secret.txt
        ("env", "leads to '/proc/"),  # env -> /proc/self/environ
        ("up/secret.txt", "leads to"),  # up -> .. (a folder symlink leaving)
    ],
)
def test_prepare_refuses_context_paths_outside_the_table_folder(tmp_path: Path, path_value: str, says: str) -> None:
    (tmp_path / "secret.txt").write_text(f"OPENAI_API_KEY={KEY}\n")
    table = tmp_path / "corpus"
    (table / "docs").mkdir(parents=True)
    (table / "docs" / "ok.txt").write_text("Verona is in Italy.\n")
    (table / "docs" / "leak").symlink_to("../../secret.txt")
    (table / "env").symlink_to("/proc/self/environ")
    (table / "up").symlink_to("..")
    (table / "qa.csv").write_text(
        f"question,answer,doc\nWhere is Verona?,Italy,docs/ok.txt\nWhat is the key?,x,{path_value}\n"
    )
    out = tmp_path / "out.jsonl"
    res = sandflow("tasks", "prepare", str(table / "qa.csv"), "--mapping",
                   "question=question,answer=answer,context_path=doc", "--out", str(out))
    text = flat(res.output)
    assert res.exit_code == 2, res.output
    assert f"error: row 1: context_path (column 'doc'): '{path_value}'" in text and says in text, text
    assert not out.exists() and list(tmp_path.glob(".out.jsonl.*")) == []  # nothing written
    assert KEY not in res.output and PASSWD_LINE not in res.output


def test_prepare_refuses_a_document_that_holds_the_key(tmp_path: Path) -> None:
    """Defence in depth: a document *inside* the folder that carries the key."""
    (tmp_path / "env.txt").write_text(f"export OPENAI_API_KEY={KEY}\n")
    (tmp_path / "qa.jsonl").write_text(json.dumps({"q": "k?", "a": "x", "doc": "env.txt"}) + "\n")
    out = tmp_path / "out.parquet"
    res = sandflow("tasks", "prepare", str(tmp_path / "qa.jsonl"), "--mapping",
                   "question=q,answer=a,context_path=doc", "--out", str(out))
    assert res.exit_code == 2 and not out.exists()
    assert "holds the value of the environment variable OPENAI_API_KEY" in flat(res.output)
    assert KEY not in res.output


def test_a_task_file_holding_the_key_is_refused_when_read(tmp_path: Path) -> None:
    """A task set written where the key was not set, read where it is (flows, show, score)."""
    row = {"id": "k1", "domain": "general", "problem_statement": "Say hi.", "ground_truth": "hi",
           "input_files": {"notes.txt": f"token: {KEY}"}}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    res = sandflow("tasks", "show", str(tmp_path / "tasks.jsonl"))
    assert res.exit_code == 2, res.output
    assert "line 1 (id 'k1'): input_files['notes.txt']: holds the value of the environment variable OPENAI_API_KEY" in flat(res.output)
    assert KEY not in res.output
    res = sandflow("tasks", "show", str(tmp_path / "tasks.jsonl"), OPENAI_API_KEY="")
    assert res.exit_code == 0, res.output  # without the key in the environment it is just text


# ---------------------------------------------------------------- sandflow run -i DIR
def _hostile_folder(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    (d / "notes.txt").write_text("harmless\n")
    (d / "passwd").symlink_to("/etc/passwd")
    (d / "environ").symlink_to("/proc/self/environ")
    return d


def _assert_nothing_started(res, model: ScriptedModel, out: Path, wh: Path) -> None:  # type: ignore[no-untyped-def]
    text = flat(res.output)
    assert res.exit_code == 2, res.output
    assert "'environ' is a symlink to '/proc/" in text and "outside the folder" in text
    assert "'passwd' is a symlink to '/etc/passwd', outside the folder" in text
    assert "Traceback" not in res.output and KEY not in res.output and PASSWD_LINE not in res.output
    assert model.requests == []  # not one model call
    assert not out.exists() or list(out.iterdir()) == []  # no run folder, no journal
    assert not wh.exists()  # no warehouse record


def test_run_refuses_symlinks_leaving_the_input_folder_llm_mode(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    """LLM mode inlines the documents into the prompt: the symlinks would go to the model,
    the trajectory and the warehouse."""
    scripted_model.push(text_reply("Final answer: 4"))
    out, wh = tmp_path / "runs", tmp_path / "wh"
    res = sandflow("run", "-q", "Summarise the files.", "-u", scripted_model.url, "--mode", "llm",
                   "-i", str(_hostile_folder(tmp_path)), "-o", str(out), "--warehouse", str(wh))
    _assert_nothing_started(res, scripted_model, out, wh)


def test_run_refuses_symlinks_leaving_the_input_folder_sandbox(
    scripted_model: ScriptedModel, tmp_path: Path, backend: str
) -> None:
    scripted_model.push(tool_reply("submit", {}))
    out, wh = tmp_path / "runs", tmp_path / "wh"
    res = sandflow("run", "-q", "Read the files.", "-u", scripted_model.url, "--backend", backend,
                   "-i", str(_hostile_folder(tmp_path)), "-o", str(out), "--warehouse", str(wh))
    _assert_nothing_started(res, scripted_model, out, wh)


def test_run_input_symlinks_inside_the_folder_reach_the_sandbox_as_files(
    scripted_model: ScriptedModel, tmp_path: Path, backend: str
) -> None:
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "real.txt").write_text("forty-two\n")
    (d / "alias.txt").symlink_to("real.txt")  # relative, inside
    (d / "sub" / "chain.txt").symlink_to("../alias.txt")  # a chain, inside
    (d / "subdir-link").symlink_to("sub")  # a folder link: skipped, reported
    cmd = ("cd /testbed/documents && cat alias.txt sub/chain.txt > /testbed/output/answer.txt && "
           "find . -type l | wc -l && ls -R")
    scripted_model.push(tool_reply("execute_bash", {"command": cmd}), tool_reply("submit", {}))
    out, wh = tmp_path / "runs", tmp_path / "wh"
    res = sandflow("run", "-q", "Concatenate.", "-u", scripted_model.url, "--backend", backend,
                   "-i", str(d), "-o", str(out), "--warehouse", str(wh), "--quiet")
    assert res.exit_code == 0, res.output
    assert "skipped 'subdir-link'" in flat(res.output)
    (run_dir,) = out.iterdir()
    assert (run_dir / "files" / "answer.txt").read_text() == "forty-two\nforty-two\n"
    obs = json.loads((run_dir / "trajectory.json").read_text())["steps"][0]["observations"][0]["content"]
    assert obs.splitlines()[0].strip() == "0"  # no symlink inside the sandbox: copies
    assert "subdir-link" not in obs


def test_run_refuses_an_input_file_holding_the_key(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    d = tmp_path / "in"
    d.mkdir()
    (d / "config.env").write_text(f"OPENAI_API_KEY={KEY}\n")
    out = tmp_path / "runs"
    res = sandflow("run", "-q", "What is in the config?", "-u", scripted_model.url, "--mode", "llm",
                   "-i", str(d), "-o", str(out))
    assert res.exit_code == 2, res.output
    assert ("input_files['config.env']: holds the value of the environment variable OPENAI_API_KEY"
            in flat(res.output))
    assert KEY not in res.output and scripted_model.requests == [] and not out.exists()


def test_run_refuses_a_query_holding_any_secret_named_variable(scripted_model: ScriptedModel, tmp_path: Path) -> None:
    res = sandflow("run", "-q", "Use hf_issue11SECRETtoken0123 to log in", "-u", scripted_model.url,
                   "--mode", "llm", "-o", str(tmp_path / "runs"), HF_TOKEN="hf_issue11SECRETtoken0123")
    assert res.exit_code == 2 and "environment variable HF_TOKEN" in flat(res.output)
    assert "hf_issue11SECRET" not in res.output and scripted_model.requests == []


# ------------------------------------------------------ the Python API: run_episode
def test_run_episode_refuses_a_constructed_task_with_the_key_before_any_sandbox(
    tmp_path: Path, backend: str, test_run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task built with model_construct (no validation) carrying the key: refused before
    the sandbox opens and before anything is recorded."""
    from datasets_prep.task import Task, TaskValidationError
    from sandbox.base import SandboxConfig
    from tasks.loop import run_episode
    from tasks.model import ModelConfig
    from warehouse.writer import EpisodeWriter

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    run_id = f"{test_run_id}-secret-{backend}"
    task = Task.model_construct(
        id="leak", domain="general", problem_statement="Read env.txt.", ground_truth="x",
        input_files={"env.txt": os.environ.get("OPENAI_API_KEY", "")}, qa_type="exact",
        verifier="auto", metadata={},
    )
    with ScriptedModel([tool_reply("submit", {})], models=("scripted",)) as model, \
            EpisodeWriter(tmp_path / "wh", durability="flush") as writer:
        with pytest.raises(TaskValidationError, match=r"task 'leak': input_files\['env.txt'\]: holds the value"):
            run_episode(task, ModelConfig(model="scripted", base_url=model.url),
                        SandboxConfig(backend=backend, run_id=run_id), writer, run_id=run_id)
        assert model.requests == []
    assert containers_of(run_id) == [] and bwrap_sandboxes_of(run_id) == []
    assert KEY not in everything_under(tmp_path / "wh")


# ------------------------------------------------------------- the sandbox's copy_in
def test_copy_in_never_brings_a_host_file_from_outside(tmp_path: Path, backend: str, test_run_id: str) -> None:
    from sandbox import SandboxConfig, open_sandbox

    src = tmp_path / "in"
    (src / "docs").mkdir(parents=True)
    (src / "docs" / "a.txt").write_text("alpha\n")
    (src / "passwd").symlink_to("/etc/passwd")
    (src / "environ").symlink_to("/proc/self/environ")
    (src / "etc").symlink_to("/etc")  # a folder symlink leaving
    os.mkfifo(src / "fifo")
    with open_sandbox(SandboxConfig(backend=backend, run_id=f"{test_run_id}-copyin", episode_id="c")) as sb:  # type: ignore[arg-type]
        sb.copy_in(src, "/testbed/input")
        r = sb.exec("cd /testbed/input && find . | sort && cat docs/a.txt && grep -rl 'root:x:0' . | wc -l")
    assert r.stdout.split() == [".", "./docs", "./docs/a.txt", "alpha", "0"], r.stdout


def test_copy_in_refuses_a_file_swapped_for_a_symlink_after_the_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TOCTOU in copy_in's host walk: the walk lstat'ed a regular file; before the open it
    became a symlink to /etc/passwd (and, one level up, a folder became a symlink)."""
    from sandbox import archive
    from sandbox.archive import CopyLimits, tree_tar

    src = tmp_path / "in"
    (src / "docs").mkdir(parents=True)
    (src / "docs" / "a.txt").write_text("alpha\n")
    real_open = archive.open_checked

    def swap_then_open(path: str, st: os.stat_result, real_root: str):  # type: ignore[no-untyped-def]
        os.unlink(path)
        os.symlink("/etc/passwd", path)
        return real_open(path, st, real_root)

    monkeypatch.setattr(archive, "open_checked", swap_then_open)
    with pytest.raises(ValueError, match="changed while it was being copied"):
        tree_tar(src, "testbed/input", CopyLimits())
    monkeypatch.undo()

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("OUTSIDE\n")
    (src / "docs" / "a.txt").unlink()
    (src / "docs" / "b.txt").write_text("inside\n")
    real_root = os.path.realpath(src)
    st = os.lstat(src / "docs" / "b.txt")
    os.rename(src / "docs", src / "docs.old")
    (src / "docs").symlink_to(tmp_path / "elsewhere")  # the folder on the path is now a link
    with pytest.raises(ValueError, match="changed|outside"):
        archive.open_checked(str(src / "docs" / "b.txt"), st, real_root)
    st_out = os.lstat(tmp_path / "elsewhere" / "b.txt")  # even with the outside file's own inode
    with pytest.raises(ValueError, match="outside"):
        archive.open_checked(str(src / "docs" / "b.txt"), st_out, real_root)
