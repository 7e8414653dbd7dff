"""An empty build (every candidate dropped) and an empty SFT set (no calibration) are one
clear sentence and files the loaders read as empty (issue #36): the dataset card's own
`load_dataset` lines crashed on them (StopIteration on the empty sft.jsonl, "ArrowInvalid:
BatchSize must be greater than 0" on the 0-row train.parquet). Read with the real
`datasets` package, pyarrow, and the card's code run as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tests.datagen.test_build_stages import corpus, generator  # noqa: F401 (fixtures)
from tests.scripted_model import ScriptedModel, text_reply

runner = CliRunner(env={"COLUMNS": "200"})
COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def run_card_code(out: Path) -> dict:
    """Run the card's python block in the build folder, as a user pastes it."""
    card = (out / "README.md").read_text()
    block = re.search(r"```python\n(.*?)\n```", card, re.S)
    assert block, card
    here = os.getcwd()
    os.chdir(out)
    try:
        scope: dict = {}
        exec(compile(block.group(1), str(out / "README.md"), "exec"), scope)  # noqa: S102
        return scope
    finally:
        os.chdir(here)


def _build(tmp_path: Path, corpus: Path, gen: ScriptedModel) -> object:  # noqa: F811
    return runner.invoke(app, ["data", "build", str(corpus), "--out", str(tmp_path / "out"), "--warehouse",
                               str(tmp_path / "wh"), "--base-url", gen.url, "--model", "scripted",
                               "--no-calibrate"])


@pytest.mark.usefixtures("prefect_harness")
def test_an_empty_build_is_one_sentence_and_files_every_loader_reads_as_empty(tmp_path, corpus):  # noqa: F811
    from datasets import load_dataset

    with ScriptedModel(default=lambda body, i: text_reply('{"question": "cut'), models=("scripted",)) as gen:
        res = _build(tmp_path, corpus, gen)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    line = next(ln for ln in res.output.splitlines() if ln.startswith("empty: "))
    assert line == (f"empty: the build is empty: no task survived (ingest dropped 1 (binary=1); synth dropped 15 "
                    f"(malformed_json=15)), so train.parquet and sft.jsonl hold no rows; see `sandflow data "
                    f"funnel --out {out}`")
    table = pq.read_table(out / "train.parquet")
    assert table.num_rows == 0 and table.schema.names == COLUMNS
    streamed = load_dataset("parquet", data_files=str(out / "train.parquet"), streaming=True)["train"]
    assert list(streamed) == [] and streamed.column_names == COLUMNS
    assert (out / "sft.jsonl").read_bytes() == b""
    card = (out / "README.md").read_text()
    assert "**Empty: the build is empty: no task survived" in card
    assert "# train.parquet: no rows, nothing to load" in card and "# sft.jsonl: no rows" in card
    run_card_code(out)  # the card's own lines: no crash


@pytest.mark.usefixtures("prefect_harness")
def test_a_build_without_calibration_has_a_card_whose_lines_load(tmp_path, corpus):  # noqa: F811
    with ScriptedModel(default=generator, models=("scripted",)) as gen:
        res = _build(tmp_path, corpus, gen)
    assert res.exit_code == 0, res.output
    assert "empty:" not in res.output
    assert "LLM-in-Sandbox-RL's reward: instruct_pretrain (5 rows): routed, by-qa-type" in res.output
    scope = run_card_code(tmp_path / "out")  # no SFT rows (nothing calibrated): no line for them
    assert len(scope["train"]) == 5 and "sft" not in scope


@pytest.mark.usefixtures("prefect_harness")
def test_data_export_names_a_domain_lis_rl_cannot_route(tmp_path, corpus):  # noqa: F811
    with ScriptedModel(default=generator, models=("scripted",)) as gen:
        res = runner.invoke(app, ["data", "build", str(corpus), "--out", str(tmp_path / "out"), "--warehouse",
                                  str(tmp_path / "wh"), "--base-url", gen.url, "--model", "scripted",
                                  "--no-calibrate", "--domain", "general"])
    assert res.exit_code == 0, res.output
    assert "LLM-in-Sandbox-RL's reward: general (5 rows): NO ROUTE" in res.output
    assert ("warning: domain 'general' (5 rows) has no route in LLM-in-Sandbox-RL's reward (it routes math, "
            "physics, chem, biomed, instruct_follow, instruct_pretrain, long_context): its trainer fails on "
            "these rows; build with --domain instruct_pretrain for context-based questions") in res.output
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- domain `general`: 5 rows, **no route**" in card and "**Warning: domain 'general'" in card
