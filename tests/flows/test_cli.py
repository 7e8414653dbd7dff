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


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("command", ["flows run", "bench"])
def test_a_run_with_some_failed_episodes_exits_1_after_its_results(
    tmp_path: Path, model: Any, command: str
) -> None:
    """Issue #37: a run where some episodes failed after their retries (one of three here:
    the endpoint rejects its requests) exited 0. Its results are shown, then one sentence
    naming how many failed and the first, exit 1; the run is recorded `failed`."""
    from tests.flows.conftest import ANSWER
    from tests.scripted_model import Fault, text_reply

    def reply(body: dict, index: int) -> Any:
        text = " ".join(str(m.get("content")) for m in body.get("messages", []))
        return Fault("status", 400, message="t1 is refused") if "Task t1:" in text else text_reply(ANSWER)

    model.default = reply
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(3))
    rid = new_run_id("somefail")
    common = ["--run-id", rid, "--mode", "llm", "--base-url", model.url, "--model", "scripted",
              "--warehouse", str(tmp_path / "wh")]  # fmt: skip
    if command == "flows run":
        args = ["flows", "run", str(ts), "--retries", "0", *common]
    else:  # bench retries under the default policy (2 retries, 2 s then 4 s)
        args = ["bench", "--suite", str(ts), "--no-rollouts", *common]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    out = " ".join(res.output.split())
    assert f"run {rid}: 1 of 3 episodes failed after their retries (first: t1" in out, out
    assert "t1 is refused" in out and f"Resume with --run-id {rid}" in out
    assert ("next: sandflow flows score" if command == "flows run" else "Accuracy") in out  # results first
    from warehouse import Warehouse

    assert Warehouse(tmp_path / "wh").run_info(rid)["status"] == "failed"  # type: ignore[index]
