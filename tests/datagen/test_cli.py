"""`sandflow data ...`: bad input is one sentence and exit 2 before any model call; the whole
build through the CLI (scripted generator, real Prefect, warehouse and files)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tests.datagen.test_build_stages import corpus, eval_set, generator  # noqa: F401 (fixtures)
from tests.scripted_model import ScriptedModel

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def gen():
    with ScriptedModel(default=generator, models=("scripted",)) as server:
        yield server


def assert_no_blank_column(output: str) -> None:
    """Every column of the funnel table has a header and at least one non-blank cell (a
    blank trailing column was printed on every first build: issue #36, "Small")."""
    lines = [ln for ln in output.splitlines() if ln.startswith(("┃", "│"))]
    assert lines, output
    cells = [[c.strip() for c in ln.strip("┃│").replace("┃", "│").split("│")] for ln in lines]
    widths = {len(c) for c in cells}
    assert len(widths) == 1, cells
    for i in range(widths.pop()):
        column = [row[i] for row in cells]
        assert column[0] and any(column[1:]), (i, column, output)


def _base(gen, tmp_path):
    return ["--out", str(tmp_path / "out"), "--warehouse", str(tmp_path / "wh"),
            "--base-url", gen.url, "--model", "scripted"]


def test_bad_input_is_one_sentence_exit_2_before_any_model_call(tmp_path, gen, corpus):  # noqa: F811
    (tmp_path / "a.docx").write_bytes(b"PK")
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.yaml").write_text("name: t\nsystem: [unclosed\n")
    cases = [
        (["data", "build", str(tmp_path / "nope"), *_base(gen, tmp_path)], "does not exist"),
        (["data", "build", str(tmp_path / "a.docx"), *_base(gen, tmp_path)], "is a .docx file"),
        (["data", "build", str(corpus), *_base(gen, tmp_path), "--types", "essay"], "--types 'essay'"),
        (["data", "build", str(corpus), *_base(gen, tmp_path), "--band", "0.9:0.1"], "LOW <= HIGH"),
        (["data", "build", str(corpus), *_base(gen, tmp_path), "--structured", "xml"], "--structured 'xml'"),
        (["data", "build", str(corpus), *_base(gen, tmp_path), "--decontaminate-against", "no-such-suite"],
         "--decontaminate-against 'no-such-suite'"),
        # `-d math` read like a domain and decontaminated silently (issue #36): retired, one sentence
        (["data", "build", str(corpus), *_base(gen, tmp_path), "-d", "math"],
         "-d is no longer a flag; for evaluation sets to decontaminate against use "
         "--decontaminate-against math, for the tasks' domain --domain"),
        (["data", "clean", "--out", str(tmp_path / "out"), "-d", "math"], "-d is no longer a flag"),
        (["data", "build", str(corpus), *_base(gen, tmp_path), "--template", str(tmp_path / "t.yaml")],
         "prompt template"),
        (["data", "build", str(corpus), *_base(gen, tmp_path), "--template", str(tmp_path / "bad.yaml")],
         f"prompt template {str(tmp_path / 'bad.yaml')!r} is not valid YAML: expected ',' or ']', but got "
         "'<stream end>' at line 3, column 1"),
        (["data", "build", str(corpus), *_base(gen, tmp_path), "--piece-tokens", "3"], "--piece-tokens 3"),
        (["data", "ingest", str(corpus), "--out", str(tmp_path / "file")], "is a file"),
        (["data", "synth", *_base(gen, tmp_path / "fresh")], "run the ingest stage first"),
    ]
    for args, needle in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output and "Traceback" not in res.output, (args, res.output)
    assert gen.requests == []


@pytest.mark.usefixtures("prefect_harness")
def test_the_whole_build_through_the_cli_without_calibration(tmp_path, gen, corpus, eval_set):  # noqa: F811
    out = tmp_path / "out"
    res = runner.invoke(app, ["data", "build", str(corpus), *_base(gen, tmp_path),
                              "--decontaminate-against", eval_set, "--no-calibrate", "--build-id", "cli-build"])
    assert res.exit_code == 0, res.output
    assert_no_blank_column(res.output)
    assert "data build cli-build" in res.output and "data_funnel" in res.output
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert len(rows) == 4
    info = rows[0]["extra_info"]
    assert info["problem_statement"] and json.loads(info["input_files"])
    assert json.loads(info["metadata"])["provenance"]["build_id"] == "cli-build"
    card = (out / "README.md").read_text()
    assert "| synth | 15 | 7 | 8 |" in card and "| clean | 7 | 4 | 3 |" in card
    assert "questions.v1@" in card and eval_set in card
    res = runner.invoke(app, ["data", "funnel", "--out", str(out), "--json"])
    stages = json.loads(res.output)
    assert [(s["stage"], s["items_in"], s["items_out"], s["consistent"]) for s in stages] == [
        ("ingest", 6, 5, True), ("synth", 15, 7, True), ("clean", 7, 4, True),
        ("calibrate", 4, 4, True), ("export", 4, 4, True)]
    # the same build again: every stage reused, no model call
    n = len(gen.requests)
    # (under the old flag name: still taken, with one deprecation line)
    res = runner.invoke(app, ["data", "build", str(corpus), *_base(gen, tmp_path), "--decontaminate", eval_set,
                              "--no-calibrate", "--build-id", "cli-build"])
    assert res.exit_code == 0 and len(gen.requests) == n and res.output.count("reused") >= 3
    assert "--decontaminate is deprecated; use --decontaminate-against" in res.output
    assert_no_blank_column(res.output)
    assert "contaminated=1" in res.output  # the old name still decontaminates
    res = runner.invoke(app, ["sql", "-w", str(tmp_path / "wh"), "--format", "json",
                              "SELECT stage, items_in, items_out, consistent FROM data_funnel"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)[1] == {"stage": "synth", "items_in": 15, "items_out": 7, "consistent": True}
