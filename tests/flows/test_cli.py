"""The flows' CLI: `--help` that teaches, and bad input answered with one clear sentence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tests.flows.conftest import new_run_id, tiny_tasks, write_tasks

runner = CliRunner(env={"COLUMNS": "200"})


def test_help_lists_the_pipeline() -> None:
    res = runner.invoke(app, ["flows", "--help"])
    assert res.exit_code == 0
    for cmd in ("prepare", "run", "score", "usage", "tokens", "rollouts", "report"):
        assert cmd in res.output
    res = runner.invoke(app, ["bench", "--help"])
    assert res.exit_code == 0 and "--run-id" in res.output and "--dask-address" in res.output


def test_usage_rules_table_prints() -> None:
    res = runner.invoke(app, ["flows", "usage", "--rules"])
    assert res.exit_code == 0
    assert "external_resource" in res.output and "pip install" in res.output


@pytest.mark.usefixtures("prefect_harness")
def test_bad_input_gets_one_clear_sentence(tmp_path: Path) -> None:
    res = runner.invoke(app, ["flows", "run", str(tmp_path / "missing.parquet"), "--warehouse", str(tmp_path)])
    assert res.exit_code == 1 and "task set file" in res.output and "does not exist" in res.output
    assert "Traceback" not in res.output

    res = runner.invoke(app, ["flows", "run", "no-such-suite", "--warehouse", str(tmp_path)])
    assert res.exit_code == 1 and "neither a built-in suite" in res.output

    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(1))
    res = runner.invoke(app, ["flows", "run", str(ts), "--mode", "sideways", "--base-url", "http://127.0.0.1:9/v1",
                              "--warehouse", str(tmp_path)])
    assert res.exit_code == 1 and "--mode 'sideways'" in res.output

    res = runner.invoke(app, ["flows", "run", str(ts), "--mode", "llm", "--base-url", "http://127.0.0.1:9/v1",
                              "--model", "m", "--warehouse", str(tmp_path)])
    assert res.exit_code == 1 and "does not answer" in res.output

    res = runner.invoke(app, ["flows", "score", "--run-id", "nope", "--warehouse", str(tmp_path / "absent")])
    assert res.exit_code == 1 and "does not exist" in res.output

    (tmp_path / "wh").mkdir()
    res = runner.invoke(app, ["flows", "report", "--run-id", "nope", "--warehouse", str(tmp_path / "wh")])
    assert res.exit_code == 1 and "run 'nope' has no episodes" in res.output


def test_run_ends_by_compacting_its_files_unless_told_not_to(tmp_path: Path, model: Any) -> None:
    """`flows run` merges a run's per-episode files at its end and says so; --no-compact keeps them."""
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(3))
    common = ["--mode", "llm", "--base-url", model.url, "--model", "scripted", "--warehouse", str(tmp_path / "wh")]

    res = runner.invoke(app, ["flows", "run", str(ts), "--run-id", new_run_id("cmp"), *common])
    assert res.exit_code == 0, res.output
    assert "3 recorded" in res.output and "compacted 6 files (episodes 3, turns 3)" in res.output

    rid = new_run_id("nocmp")
    res = runner.invoke(app, ["flows", "run", str(ts), "--run-id", rid, "--no-compact", *common])
    assert res.exit_code == 0, res.output
    assert "compacted" not in res.output
    assert len(list((tmp_path / "wh" / "episodes" / f"run_id={rid}").glob("*.parquet"))) == 3


@pytest.mark.usefixtures("prefect_harness")
def test_a_run_whose_episodes_all_fail_exits_1_naming_them(tmp_path: Path, model: Any) -> None:
    """Issue #22 item 7: every episode failed after its retries (here the endpoint rejects
    every request): `flows run` says so in one sentence and exits 1, never 0."""
    from tests.scripted_model import Fault

    model.default = Fault("status", 400, message="the request is malformed")  # never retried
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(2))
    rid = new_run_id("allfail")
    res = runner.invoke(app, ["flows", "run", str(ts), "--run-id", rid, "--mode", "llm", "--retries", "0",
                              "--base-url", model.url, "--model", "scripted", "--warehouse", str(tmp_path / "wh")])
    assert res.exit_code == 1, res.output
    out = " ".join(res.output.split())
    assert f"run {rid}: all 2 episodes failed (first: t" in out, out
    assert "model_error" in out and "the request is malformed" in out
    assert "Traceback" not in res.output
    from warehouse import Warehouse

    assert Warehouse(tmp_path / "wh").run_info(rid)["status"] == "failed"  # type: ignore[index]
