"""`--network` on `sandflow run`, `sandflow flows run` and `sandflow bench`: one policy
string (`allowlist:ENTRIES`, `none`, `open`, `bridge`), checked at once with the bad entry
named, and carried to the sandbox / the run's recorded config."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandbox import SandboxLimits, egress
from sandflow.cli import app
from tests.flows.conftest import new_run_id, tiny_tasks, write_tasks
from tests.scripted_model import ScriptedModel, tool_reply

runner = CliRunner(env={"COLUMNS": "200"})
GOOD = "allowlist:pypi.org *.pythonhosted.org:443"


@pytest.fixture
def model() -> Iterator[ScriptedModel]:
    from tests.flows.conftest import solver

    with ScriptedModel(default=solver, models=("scripted",)) as server:
        yield server


def flat(text: str) -> str:
    """Output without rich's box drawing and line wrapping."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize("command", [["run"], ["flows", "run"], ["bench"]])
def test_help_teaches_the_policy_syntax(command: list[str]) -> None:
    res = runner.invoke(app, [*command, "--help"])
    assert res.exit_code == 0, res.output
    out = flat(res.output)
    assert "--network" in out and "allowlist:pypi.org *.pythonhosted.org:443" in out
    assert "*.domain" in out and "8000-8010" in out


@pytest.mark.parametrize(
    "command", [["run", "-q", "x", "--mode", "llm"], ["flows", "run", "smoke"], ["bench"]]
)
@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("allowlist:pypi.org bad|host", "allowlist entry 'bad|host': not a hostname"),
        ("allowlist:pypi.org:99999", "port range '99999' is outside 1-65535"),
        ("allowlst:pypi.org", "unknown policy 'allowlst'"),
        ("none:pypi.org", "only 'allowlist' takes entries"),
        ("allowlist:", "name what the allowlist lets through"),
    ],
)
def test_a_bad_policy_stops_the_command_at_once_naming_the_entry(
    command: list[str], value: str, named: str, tmp_path: Path
) -> None:
    res = runner.invoke(app, [*command, "--network", value, "--warehouse", str(tmp_path)])
    out = flat(res.output)
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--network'" in out and named in out, out
    assert "Traceback" not in res.output
    assert not any(tmp_path.iterdir())  # stopped before anything was written


def test_sandbox_exec_takes_the_same_policy_string() -> None:
    """`sandflow sandbox exec` checks the same syntax (flag or SANDFLOW_NETWORK) before any
    sandbox starts."""
    res = runner.invoke(app, ["sandbox", "exec", "--network", "allowlist:bad..name", "true"])
    assert res.exit_code == 2, res.output
    assert "allowlist entry 'bad..name'" in flat(res.output)
    res = runner.invoke(
        app, ["sandbox", "exec", "true"], env={"SANDFLOW_NETWORK": "allowlst:x.org"}
    )
    assert res.exit_code == 2, res.output
    assert "unknown policy 'allowlst'" in flat(res.output)
    res = runner.invoke(app, ["sandbox", "exec", "--help"])
    assert "allowlist:pypi.org *.pythonhosted.org:443" in flat(res.output)


def test_a_bad_policy_from_the_environment_is_one_sentence(tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        ["flows", "run", "smoke", "--warehouse", str(tmp_path)],
        env={"SANDFLOW_NETWORK": "allowlist:ok.org no_such:port"},
    )
    assert res.exit_code == 1, res.output
    out = flat(res.output)
    assert "invalid setting network" in out and "'no_such:port'" in out, out
    assert "Traceback" not in res.output


@pytest.mark.usefixtures("prefect_harness")
def test_flows_run_records_the_policy_it_was_given(tmp_path: Path, model: ScriptedModel) -> None:
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(1))
    rid = new_run_id("net")
    wh = tmp_path / "wh"
    args = ["flows", "run", str(ts), "--run-id", rid, "--mode", "llm", "--base-url", model.url]
    args += ["--model", "scripted", "--warehouse", str(wh), "--network", GOOD]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    from warehouse.query import WarehouseQuery

    with WarehouseQuery(wh) as q:
        (config,) = q.rows(f"SELECT config FROM runs WHERE run_id = '{rid}'")[0]
    assert json.loads(config)["network"] == GOOD


@pytest.mark.docker
@pytest.mark.skipif(egress.unavailable() is not None, reason=str(egress.unavailable()))
def test_run_puts_the_sandbox_behind_the_proxy_the_flag_names(
    scripted_model: ScriptedModel, tmp_path: Path, sandbox_image: str
) -> None:
    """`sandflow run --network allowlist:...`: the sandbox's traffic goes through the
    egress proxy of that policy, which refuses (and records) what is not listed."""
    policy = "allowlist:listed.invalid:8080"
    probe = (
        "curl -s -o /dev/null -w '%{http_code}' http://notlisted.invalid/; echo \" $http_proxy\""
    )
    scripted_model.push(
        tool_reply("execute_bash", {"command": probe}),
        tool_reply("submit", {}),
    )
    out = tmp_path / "runs"
    res = runner.invoke(
        app,
        ["run", "-q", "fetch it", "-u", scripted_model.url, "-o", str(out), "--max-steps", "3"]
        + ["--network", policy, "--quiet"],
    )
    from sandbox.engine import docker_client

    api = docker_client().api
    endpoint = egress.endpoint_for(api, SandboxLimits(network=policy))
    try:
        assert res.exit_code == 0, res.output
        (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
        turns = [
            json.loads(line)
            for line in (run_dir / "records.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "turn"
        ]
        seen = turns[0]["record"]["observations"][0]["content"]
        assert seen.split()[:2] == ["403", endpoint.proxy_url], seen
        (request,) = turns[0]["record"]["egress"]
        assert (request["host"], request["allowed"], request["rule"]) == (
            "notlisted.invalid",
            False,
            "deny: not in allowlist",
        )
    finally:
        egress.teardown(api, endpoint)
