"""`--durability` on `flows run`, `bench` and `rl serve` (or SANDFLOW_DURABILITY, or
`durability` in sandflow.toml): what a recorded run survives, checked at once and carried
to the run's recorded config (the run flow hands it to the warehouse writer)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandflow.cli import app
from tests.flows.conftest import new_run_id, tiny_tasks, write_tasks
from tests.scripted_model import ScriptedModel

runner = CliRunner(env={"COLUMNS": "200"})


def flat(text: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.fixture
def model() -> Iterator[ScriptedModel]:
    from tests.flows.conftest import solver

    with ScriptedModel(default=solver, models=("scripted",)) as server:
        yield server


@pytest.mark.parametrize("command", [["flows", "run"], ["bench"], ["rl", "serve"]])
def test_help_names_the_three_modes_and_what_each_survives(command: list[str]) -> None:
    res = runner.invoke(app, [*command, "--help"])
    assert res.exit_code == 0, res.output
    out = flat(res.output)
    assert "--durability" in out and "SANDFLOW_DURABILITY" in out, out
    assert "<turn|sync|flush>" in out and "kill -9 loses nothing" in out, out


@pytest.mark.parametrize("command", [["flows", "run", "smoke"], ["bench"], ["rl", "serve"]])
def test_an_unknown_mode_stops_the_command_before_anything_is_written(
    command: list[str], tmp_path: Path
) -> None:
    res = runner.invoke(app, [*command, "--durability", "maybe", "--warehouse", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--durability'" in flat(res.output)
    assert "Traceback" not in res.output and not any(tmp_path.iterdir())


def test_an_unknown_mode_from_the_environment_is_one_sentence(tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        ["flows", "run", "smoke", "--warehouse", str(tmp_path)],
        env={"SANDFLOW_DURABILITY": "always"},
    )
    assert res.exit_code == 1, res.output
    out = flat(res.output)
    assert "invalid setting durability" in out and "'turn', 'sync' or 'flush'" in out, out
    assert "Traceback" not in res.output


@pytest.mark.usefixtures("prefect_harness")
def test_the_flag_beats_the_environment_and_the_run_records_its_mode(
    tmp_path: Path, model: ScriptedModel
) -> None:
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(1))
    wh = tmp_path / "wh"
    base = ["flows", "run", str(ts), "--mode", "llm", "--base-url", model.url]
    base += ["--model", "scripted", "--warehouse", str(wh)]
    runs = {
        new_run_id("dur-env"): ([], "flush"),  # SANDFLOW_DURABILITY alone
        new_run_id("dur-flag"): (["--durability", "sync"], "sync"),  # the flag wins
    }
    for rid, (extra, _) in runs.items():
        res = runner.invoke(
            app, [*base, "--run-id", rid, *extra], env={"SANDFLOW_DURABILITY": "flush"}
        )
        assert res.exit_code == 0, res.output
    from warehouse.query import WarehouseQuery

    with WarehouseQuery(wh) as q:
        got = dict(q.rows("SELECT run_id, config FROM runs"))
    assert {rid: json.loads(got[rid])["durability"] for rid in runs} == {
        rid: mode for rid, (_, mode) in runs.items()
    }


@pytest.mark.usefixtures("prefect_harness")
def test_bench_and_flows_run_take_the_same_settings(tmp_path: Path, model: ScriptedModel) -> None:
    """Both commands build their RunSpec from the settings the same way: the sandbox
    backend, the durability and the network come from SANDFLOW_* for `bench` too (it
    once ran docker whatever SANDFLOW_BACKEND said)."""
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(1))
    wh = tmp_path / "wh"
    env = {"SANDFLOW_BACKEND": "bwrap", "SANDFLOW_DURABILITY": "sync", "SANDFLOW_NETWORK": "open"}
    common = ["--mode", "llm", "--base-url", model.url, "--model", "scripted"]
    common += ["--warehouse", str(wh)]
    rids = [new_run_id("same-run"), new_run_id("same-bench")]
    res = runner.invoke(app, ["flows", "run", str(ts), "--run-id", rids[0], *common], env=env)
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app, ["bench", "--suite", str(ts), "--run-id", rids[1], "--no-rollouts", *common], env=env
    )
    assert res.exit_code == 0, res.output
    from warehouse.query import WarehouseQuery

    with WarehouseQuery(wh) as q:
        got = dict(q.rows("SELECT run_id, config FROM runs"))
    seen = {
        rid: {k: json.loads(got[rid])[k] for k in ("backend", "durability", "network")}
        for rid in rids
    }
    want = {"backend": "bwrap", "durability": "sync", "network": "open"}
    assert seen == {rid: want for rid in rids}
