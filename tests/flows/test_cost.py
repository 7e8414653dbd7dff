"""What a run costs (issue #28), for real: Prefect (the session harness), Docker, DuckDB
and HTTP to a scripted model whose every reply reports the same usage, so every cost is
known to the cent.

Every reply: 100,000 prompt tokens of which 40,000 cached, 2,000 completion tokens of
which 500 reasoning. At $2.50 / $1.25 / $10 / $20 per million (input, cached input,
output, reasoning) a turn costs 0.15 + 0.05 + 0.015 + 0.01 = $0.225. A sandbox episode of
the solver is 4 turns ($0.90), an LLM-mode episode 1 turn ($0.225).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.flows.conftest import new_run_id, run_kwargs, solver, tiny_tasks, write_tasks
from tests.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.usefixtures("prefect_harness", "docker_image")

USAGE = {
    "prompt_tokens": 100_000,
    "completion_tokens": 2_000,
    "total_tokens": 102_000,
    "prompt_tokens_details": {"cached_tokens": 40_000},
    "completion_tokens_details": {"reasoning_tokens": 500},
}
PRICES = {"scripted": {"input": 2.5, "cached_input": 1.25, "output": 10.0, "reasoning": 20.0}}
TURN_USD = 0.225


def fixed_usage(body: dict, index: int) -> Reply:
    reply = solver(body, index)
    reply.usage = dict(USAGE)
    return reply


def no_usage(body: dict, index: int) -> Reply:
    """A server that reports no usage at all: its turns' cost is unknown, never 0."""
    reply = solver(body, index)
    reply.usage = {"note": "no counts"}
    return reply


@pytest.fixture
def priced_model() -> Iterator[ScriptedModel]:
    with ScriptedModel(default=fixed_usage, models=("scripted",)) as server:
        yield server


def _run(tmp_path: Path, server: ScriptedModel, wh: Path, tag: str, **kw: Any) -> str:
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.run import run_flow

    ts = write_tasks(tmp_path / f"{tag}.parquet", tiny_tasks(2))
    rid = new_run_id(tag)
    summary = run_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=2))(
        **run_kwargs(ts, server, wh, run_id=rid, **kw)
    )
    assert summary["failed"] == 0, summary
    return rid


def _rows(wh: Path, sql: str, **kw: Any) -> list[tuple[Any, ...]]:
    from warehouse.query import connect

    with connect(wh, **kw) as q:
        return q.rows(sql)


def _report(wh: Path, rid: str, tmp_path: Path) -> str:
    from flows.report import report_flow

    out = report_flow(run_id=rid, warehouse=str(wh), out_dir=str(tmp_path / f"report-{rid}"))
    return Path(out["markdown"]).read_text()


def test_run_cost_to_the_cent_per_turn_episode_and_run(tmp_path: Path, priced_model: ScriptedModel) -> None:
    wh = tmp_path / "wh"
    rid = _run(tmp_path, priced_model, wh, "cost", mode="both", prices=PRICES)

    # the run recorded the table it was priced with
    (cfg,) = _rows(wh, f"SELECT config FROM runs WHERE run_id = '{rid}'")[0]
    assert json.loads(cfg)["prices"] == PRICES

    turns = _rows(wh, f"SELECT round(cost_usd, 6), price_source FROM turn_cost WHERE run_id = '{rid}'")
    assert len(turns) == 2 * 4 + 2 * 1
    assert set(turns) == {(TURN_USD, "run")}

    eps = _rows(wh, f"SELECT mode, turns, unpriced_turns, round(cost_usd, 2) FROM episode_cost "
                    f"WHERE run_id = '{rid}' ORDER BY mode")  # fmt: skip
    assert eps == [("llm", 1, 0, 0.23), ("llm", 1, 0, 0.23), ("sandbox", 4, 0, 0.90), ("sandbox", 4, 0, 0.90)]

    (row,) = _rows(
        wh,
        "SELECT models, episodes, turns, prompt_tokens, cached_tokens, completion_tokens, "
        "reasoning_tokens, unpriced_turns, cost_usd, known_cost_usd, cost_per_episode "
        f"FROM run_cost WHERE run_id = '{rid}'",
    )
    models, episodes, n_turns, prompt, cached, completion, reasoning, unpriced, usd, known, per_ep = row
    assert (models, episodes, n_turns, unpriced) == ("scripted", 4, 10, 0)
    assert (prompt, cached, completion, reasoning) == (1_000_000, 400_000, 20_000, 5_000)
    assert round(usd, 2) == 2.25 and round(known, 2) == 2.25
    assert round(per_ep, 4) == round(2.25 / 4, 4)
    # the sandbox side, from each sandbox's cgroup: measured for sandbox episodes, NULL
    # (not 0) for LLM mode; the run sums the CPU and keeps the largest peak
    side = _rows(wh, f"SELECT mode, sandbox_cpu_s, sandbox_peak_memory_bytes FROM episode_cost "
                     f"WHERE run_id = '{rid}' ORDER BY mode")  # fmt: skip
    assert [(m, c, p) for m, c, p in side if m == "llm"] == [("llm", None, None)] * 2
    sandbox_side = [(c, p) for m, c, p in side if m == "sandbox"]
    assert all(c is not None and c > 0 and p is not None and p > 1 << 20 for c, p in sandbox_side), side
    (run_side,) = _rows(wh, "SELECT sandbox_episodes_measured, sandbox_cpu_s, sandbox_peak_memory_bytes "
                            f"FROM run_cost WHERE run_id = '{rid}'")  # fmt: skip
    assert run_side[0] == 2
    assert run_side[1] == pytest.approx(sum(c for c, _ in sandbox_side))
    assert run_side[2] == max(p for _, p in sandbox_side)
    # the report says it per mode and overall
    md = _report(wh, rid, tmp_path)
    assert "What the run cost" in md
    assert "| sandbox | 2 | 8 |" in md and "| 1.8000 | 0.9000 |" in md
    assert "| llm | 2 | 2 |" in md and "| 0.4500 | 0.2250 |" in md
    assert "| (all) | 4 | 10 |" in md and "| 2.2500 | 0.5625 |" in md
    assert "| sandbox_cpu_s | sandbox_peak_mib |" in md  # the sandbox side beside the dollars
    # the SQL and the library's one formula agree
    from tasks.pricing import load_prices

    price = load_prices(PRICES).lookup("scripted")
    assert price is not None
    assert price.cost(100_000, 2_000, 40_000, 500) == pytest.approx(TURN_USD)


def test_unknown_model_costs_unknown_not_zero(tmp_path: Path, priced_model: ScriptedModel) -> None:
    from tasks.pricing import load_prices

    wh = tmp_path / "wh"
    # priced, but not this model; an LLM-mode run needs no sandbox
    other = {"gpt-4o": {"input": 2.5, "output": 10.0}}
    rid = _run(tmp_path, priced_model, wh, "unpriced", mode="llm", prices=other)
    (row,) = _rows(wh, f"SELECT cost_usd, known_cost_usd, unpriced_turns, unpriced_episodes "
                       f"FROM run_cost WHERE run_id = '{rid}'")  # fmt: skip
    assert row == (None, None, 2, 2)
    assert _rows(wh, f"SELECT DISTINCT cost_usd FROM episode_cost WHERE run_id = '{rid}'") == [(None,)]
    md = _report(wh, rid, tmp_path)
    assert "| (all) | 2 | 2 |" in md and "| 2 | unknown | unknown |" in md, md
    # a price handed to the session prices what the run did not
    rows = _rows(wh, f"SELECT round(cost_usd, 3) FROM run_cost WHERE run_id = '{rid}'",
                 prices=load_prices(PRICES))  # fmt: skip
    assert rows == [(round(2 * TURN_USD, 3),)]
    # an endpoint-specific price wins over the model's
    at_endpoint = {**PRICES, f"{priced_model.url} scripted": {"input": 0.0, "output": 0.0}}
    rows = _rows(wh, f"SELECT cost_usd FROM run_cost WHERE run_id = '{rid}'", prices=load_prices(at_endpoint))
    assert rows == [(0.0,)]


def test_turns_without_usage_are_unknown(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    with ScriptedModel(default=no_usage, models=("scripted",)) as server:
        rid = _run(tmp_path, server, wh, "nousage", mode="llm", prices=PRICES)
    assert _rows(wh, f"SELECT DISTINCT cost_usd FROM turn_cost WHERE run_id = '{rid}'") == [(None,)]
    (row,) = _rows(wh, f"SELECT cost_usd, unpriced_turns FROM run_cost WHERE run_id = '{rid}'")
    assert row == (None, 2)


def test_cli_prices_flag(tmp_path: Path, priced_model: ScriptedModel) -> None:
    from sandflow.cli import app

    wh = tmp_path / "wh"
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(1))
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))
    runner = CliRunner(env={"COLUMNS": "300"})
    rid = new_run_id("cli")
    res = runner.invoke(app, ["flows", "run", str(ts), "--base-url", priced_model.url,
                              "--model", "scripted", "--mode", "llm", "--warehouse", str(wh),
                              "--run-id", rid, "--prices", str(prices)])  # fmt: skip
    assert res.exit_code == 0, res.output + repr(res.exception)
    res = runner.invoke(app, ["sql", "--warehouse", str(wh), "--format", "json", "-o",
                              str(tmp_path / "c.json"), f"SELECT round(cost_usd, 3) AS usd FROM run_cost "
                              f"WHERE run_id = '{rid}'"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "c.json").read_text()) == [{"usd": TURN_USD}]

    # bad tables: one sentence naming the file / key / field, exit 2, before any work
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"scripted": {"input": -1, "output": 1}}))
    calls = len(priced_model.requests)
    for args, words in (
        (["flows", "run", str(ts), "--base-url", priced_model.url, "--warehouse", str(wh),
          "--prices", str(bad)], ("--prices", "scripted.input", "greater than or equal to 0")),
        (["sql", "--warehouse", str(wh), "--prices", str(tmp_path / "missing.json"), "SELECT 1"],
         ("missing.json", "cannot be read")),
        (["sql", "--warehouse", str(wh), "--prices", '{"m": {"input": 1}}', "SELECT 1"],
         ("m.output", "Field required")),
    ):  # fmt: skip
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        for w in words:
            assert w in res.output, res.output
        assert "Traceback" not in res.output
    assert len(priced_model.requests) == calls


def test_settings_read_the_price_table_from_toml_env_and_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandflow.config import load_settings

    toml = tmp_path / "sandflow.toml"
    toml.write_text('[prices."scripted"]\ninput = 2.5\ncached_input = 1.25\noutput = 10.0\nreasoning = 20.0\n')
    monkeypatch.setenv("SANDFLOW_CONFIG", str(toml))
    monkeypatch.delenv("SANDFLOW_PRICES", raising=False)
    assert load_settings().prices.public_dict() == PRICES
    # the environment (a file) beats the config file; the flag beats both
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"other": {"input": 1, "output": 2}}))
    monkeypatch.setenv("SANDFLOW_PRICES", str(f))
    assert list(load_settings().prices.public_dict()) == ["other"]
    assert list(load_settings(prices=json.dumps(PRICES)).prices.public_dict()) == ["scripted"]
    # none by default: nothing is priced
    monkeypatch.delenv("SANDFLOW_PRICES")
    monkeypatch.setenv("SANDFLOW_CONFIG", str(tmp_path / "absent.toml"))
    assert not load_settings().prices
    assert load_settings().prices.lookup("scripted") is None
