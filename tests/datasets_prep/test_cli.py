"""`sandflow tasks ...` through typer's CliRunner, on real files."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from datasets_prep.io import read_taskset
from sandflow.commands.tasksets import register

app = typer.Typer()


@app.callback()
def _root() -> None:
    """test root"""


register(app)
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["tasks", *args], env={"COLUMNS": "200"})


def test_suites_and_verifiers_listed():
    r = run("suites")
    assert r.exit_code == 0 and "smoke" in r.output and "long_context" in r.output
    r = run("verifiers")
    assert r.exit_code == 0 and "choice_multi" in r.output and "judge" in r.output


def test_prepare_smoke_show_and_score(tmp_path):
    out = tmp_path / "smoke.parquet"
    r = run("prepare", "smoke", "--out", str(out), "--seed", "5")
    assert r.exit_code == 0, r.output
    assert "content hash" in r.output and "long_context" in r.output and "wrote" in r.output
    ts = read_taskset(out)
    assert len(ts) >= 10
    r = run("show", str(out), "-n", "2")
    assert r.exit_code == 0 and ts[0].id in r.output and ts[1].id in r.output
    chem = next(t for t in ts if t.qa_type == "single_choice")
    r = run("score", str(out), "--id", chem.id, "--answer", f"The answer is {chem.ground_truth}")
    assert r.exit_code == 0 and r.output.startswith("1.000")


def test_prepare_local_table_with_mapping_and_peer_export(tmp_path):
    src = tmp_path / "qa.jsonl"
    src.write_text("\n".join(json.dumps({"passage": "Bob is 7.", "q": "How old is Bob?", "a": "7"}) for _ in range(1))
                   + "\n", encoding="utf-8")
    out = tmp_path / "rl.jsonl"
    r = run("prepare", str(src), "--mapping", "context=passage,question=q,answer=a", "--out", str(out),
            "--peer", "--domain", "general")
    assert r.exit_code == 0, r.output
    row = json.loads(out.read_text().splitlines()[0])
    assert row["input_files"] == {"document_01.txt": "Bob is 7."} and "How old is Bob?" in row["problem_statement"]
    # the peer rows load back as tasks (no mapping needed)
    again = tmp_path / "again.parquet"
    assert run("prepare", str(out), "--out", str(again)).exit_code == 0
    assert read_taskset(again)[0].ground_truth == "7"


def test_bad_input_exits_2_names_row_and_writes_nothing(tmp_path):
    src = tmp_path / "bad.jsonl"
    rows = [{"id": "a", "domain": "d", "problem_statement": "q", "ground_truth": "x"},
            {"id": "a", "domain": "d", "problem_statement": "q2", "ground_truth": "y"}]
    src.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    out = tmp_path / "out.parquet"
    r = run("prepare", str(src), "--out", str(out))
    assert r.exit_code == 2 and "duplicate task ids" in r.output and "row 1: id 'a' duplicates row 0" in r.output
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_prepare_refuses_a_file_that_is_also_a_folder(tmp_path):
    """Issue #37: passed `tasks prepare`, then failed every episode placing the files."""
    src = tmp_path / "t.jsonl"
    rows = [{"id": "ok", "domain": "d", "problem_statement": "q", "ground_truth": "x", "input_files": {"a.txt": "1"}},
            {"id": "clash", "domain": "d", "problem_statement": "q", "ground_truth": "x",
             "input_files": {"a": "1", "a/b": "2"}}]
    src.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    out = tmp_path / "out.parquet"
    r = run("prepare", str(src), "--out", str(out))
    assert r.exit_code == 2, r.output
    flat = " ".join(r.output.split())
    assert "row 1 (id 'clash'): input_files: input file 'a' is also the folder of input file 'a/b'" in flat
    assert not out.exists()


def test_missing_source_and_columns(tmp_path):
    r = run("prepare", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "o.parquet"))
    assert r.exit_code == 2 and "no such file" in r.output
    src = tmp_path / "t.csv"
    src.write_text("foo,bar\n1,2\n", encoding="utf-8")
    r = run("prepare", str(src), "--out", str(tmp_path / "o.parquet"))
    assert r.exit_code == 2 and "missing column(s)" in r.output and "the table has: bar, foo" in r.output


def test_show_unknown_id(tmp_path):
    out = tmp_path / "p.jsonl"
    assert run("prepare", "physics", "--size", "2", "--out", str(out)).exit_code == 0
    r = run("show", str(out), "--id", "zzz")
    assert r.exit_code == 2 and "no task with id 'zzz'" in r.output
