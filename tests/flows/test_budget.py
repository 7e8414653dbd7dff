"""Run budgets (issue #28): `--max-cost` and `--max-run-tokens` stop a run cleanly, for
real: the CLI, Prefect (the session harness), Docker, DuckDB and HTTP to a scripted model
whose every reply reports the same usage.

Every reply: 100,000 prompt tokens (40,000 cached) and 2,000 completion tokens (500
reasoning) = 102,000 tokens, $0.225 at the test prices (tests/flows/test_cost.py). A
sandbox episode of the solver is 4 turns: 408,000 tokens, $0.90. With one episode at a
time, a budget of $1.00 (or 500,000 tokens) lets the first episode finish, stops the
second after its first turn (spent: $1.125, 510,000 tokens) and starts no third.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.flows.conftest import new_run_id, tiny_tasks, write_tasks
from tests.flows.test_cost import PRICES, fixed_usage
from tests.scripted_model import ScriptedModel

pytestmark = pytest.mark.usefixtures("prefect_harness", "docker_image")


@pytest.fixture
def priced_model() -> Iterator[ScriptedModel]:
    with ScriptedModel(default=fixed_usage, models=("scripted",)) as server:
        yield server


def _rows(wh: Path, sql: str) -> list[tuple[Any, ...]]:
    from warehouse.query import connect

    with connect(wh) as q:
        return q.rows(sql)


def _cli(server: ScriptedModel, ts: Path, wh: Path, rid: str, prices: Path | None, *flags: str) -> Any:
    from sandflow.cli import app

    args = ["flows", "run", str(ts), "--base-url", server.url, "--model", "scripted", "--mode",
            "sandbox", "-c", "1", "--retries", "0", "--warehouse", str(wh), "--run-id", rid,
            "--durability", "flush", *flags]  # fmt: skip
    if prices is not None:
        args += ["--prices", str(prices)]
    return CliRunner(env={"COLUMNS": "400"}).invoke(app, args)


def _status(wh: Path, rid: str) -> tuple[str, str | None]:
    (row,) = _rows(wh, f"SELECT status, notes FROM runs WHERE run_id = '{rid}'")
    return row[0], row[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "value", "spent_words"),
    [("--max-cost", "1.0", ("--max-cost 1 USD", "1.1250 USD")), ("--max-run-tokens", "500000", ("510000 tokens",))],
)
def test_budget_stops_the_run_and_a_higher_one_finishes_it(
    tmp_path: Path, priced_model: ScriptedModel, flag: str, value: str, spent_words: tuple[str, ...]
) -> None:
    from flows.score import score_flow

    wh = tmp_path / "wh"
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(3))
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))
    rid = new_run_id("budget")

    res = _cli(priced_model, ts, wh, rid, prices, flag, value)
    # non-zero, one sentence naming the budget and what was spent, and how to go on
    assert res.exit_code == 1, res.output + repr(res.exception)
    assert "stopped on its budget" in res.output and flag in res.output, res.output
    for w in spent_words:
        assert w in res.output, res.output
    assert f"--run-id {rid}" in res.output and "Traceback" not in res.output
    assert len(priced_model.requests) == 5  # 4 turns of the first episode, 1 of the second

    # the first episode finished; the second stopped at its next turn boundary; no third
    eps = _rows(wh, f"SELECT task_id, termination, num_turns, is_infra_failure FROM episodes "
                    f"WHERE run_id = '{rid}' ORDER BY started_at")  # fmt: skip
    assert [(t, n, i) for _, t, n, i in eps] == [("submitted", 4, False), ("budget_exhausted", 1, True)]
    status, notes = _status(wh, rid)
    assert status == "budget_exhausted" and notes and "budget" in notes and flag in notes

    # never graded: accuracy counts the finished episode only
    score_flow(run_id=rid, warehouse=str(wh))
    scored = _rows(wh, f"SELECT e.termination FROM scores s JOIN episodes e USING (run_id, episode_id) "
                       f"WHERE run_id = '{rid}'")  # fmt: skip
    assert scored == [("submitted",)]
    (acc,) = _rows(wh, f"SELECT episodes, infra_failures, scored, accuracy FROM accuracy "
                       f"WHERE run_id = '{rid}' AND mode = 'sandbox'")  # fmt: skip
    assert acc[1:] == (1, 1, 1.0), acc

    # the same budget again: it holds across the resume (the warehouse's count), nothing starts
    res = _cli(priced_model, ts, wh, rid, prices, flag, value)
    assert res.exit_code == 1 and "stopped on its budget" in res.output, res.output
    assert len(priced_model.requests) == 5

    # a higher budget finishes it: the stopped episode re-runs, the third runs
    higher = str(float(value) * 10) if flag == "--max-cost" else str(int(value) * 10)
    res = _cli(priced_model, ts, wh, rid, prices, flag, higher)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert len(priced_model.requests) == 5 + 8
    terms = _rows(wh, f"SELECT termination, count(*) FROM episodes WHERE run_id = '{rid}' GROUP BY ALL")
    assert terms == [("submitted", 3)]
    assert _status(wh, rid)[0] == "finished"
    (cost,) = _rows(wh, f"SELECT round(cost_usd, 2), prompt_tokens + completion_tokens FROM run_cost "
                        f"WHERE run_id = '{rid}'")  # fmt: skip
    assert cost == (2.70, 3 * 408_000)


def test_max_cost_without_a_price_is_refused_before_any_work(tmp_path: Path, priced_model: ScriptedModel) -> None:
    wh = tmp_path / "wh"
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(1))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"gpt-4o": {"input": 2.5, "output": 10}}))
    for prices in (None, other):
        rid = new_run_id("unpriced")
        res = _cli(priced_model, ts, wh, rid, prices, "--max-cost", "5")
        assert res.exit_code == 2, res.output + repr(res.exception)
        assert "--max-cost 5" in res.output and "no price for model 'scripted'" in res.output, res.output
        assert "Traceback" not in res.output
        assert not priced_model.requests
        assert not (wh / "runs").exists() or not _rows(wh, f"SELECT 1 FROM runs WHERE run_id = '{rid}'")


def test_engine_refuses_max_cost_without_a_price(tmp_path: Path, priced_model: ScriptedModel) -> None:
    """The library's own check (a caller without the CLI): RunConfigError, nothing recorded."""
    from engine import RunSpec, run
    from engine.plan import RunConfigError

    wh = tmp_path / "wh"
    spec = RunSpec(model="scripted", base_url=priced_model.url, mode="llm", warehouse=str(wh),
                   run_id=new_run_id("engine"), max_cost_usd=1.0)  # fmt: skip
    with pytest.raises(RunConfigError, match="no price for model 'scripted'"):
        run(tiny_tasks(1), spec)
    assert not priced_model.requests


def test_bench_stops_on_its_budget_grades_only_finished_episodes_and_exits_1(
    tmp_path: Path, priced_model: ScriptedModel
) -> None:
    """`bench` (run + score + report) with --max-run-tokens: LLM mode, 1 turn = 102,000
    tokens per episode, one at a time; 250,000 tokens: 3 episodes run (the third crosses
    it), the fourth never starts. Not one budget ending is graded; the report is written."""
    from sandflow.cli import app

    wh = tmp_path / "wh"
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(4))
    rid = new_run_id("bench-budget")
    args = ["bench", "--suite", str(ts), "--base-url", priced_model.url, "--model", "scripted",
            "--mode", "llm", "--warehouse", str(wh), "--concurrency", "1", "--no-rollouts",
            "--run-id", rid, "--max-run-tokens", "250000"]  # fmt: skip
    res = CliRunner(env={"COLUMNS": "400"}).invoke(app, args)
    assert res.exit_code == 1, res.output + repr(res.exception)
    assert "stopped on its budget" in res.output and "--max-run-tokens 250000" in res.output
    assert "306000 tokens" in res.output and "Report:" in res.output, res.output
    assert len(priced_model.requests) == 3
    # an LLM episode ends with its one reply: the budget stops only the episode not started
    eps = _rows(wh, f"SELECT termination, count(*) FROM episodes WHERE run_id = '{rid}' GROUP BY ALL")
    assert eps == [("submitted", 3)]
    (acc,) = _rows(wh, f"SELECT episodes, scored FROM accuracy WHERE run_id = '{rid}' AND mode = 'llm'")
    assert acc == (3, 3)
    assert _status(wh, rid)[0] == "budget_exhausted"


def test_a_worker_process_checks_the_warehouse_before_an_episode(tmp_path: Path, priced_model: ScriptedModel) -> None:
    """A Dask worker runs `engine.episode.attempt` with plain values and no budget of its
    own: it counts what the warehouse holds for the run, so a spent budget starts nothing."""
    from engine import RunSpec, run
    from engine.episode import attempt
    from engine.plan import plan
    from engine.retry import EpisodeCancelled

    wh = tmp_path / "wh"
    rid = new_run_id("worker")
    spec = RunSpec(model="scripted", base_url=priced_model.url, mode="llm", warehouse=str(wh),
                   run_id=rid, prices=PRICES, concurrency=1)  # fmt: skip
    tasks = tiny_tasks(2)
    assert run(tasks[:1], spec).summary["succeeded"] == 1
    assert len(priced_model.requests) == 1
    (second,) = [ep for ep in plan(tasks, rid, "llm", 1) if ep.task.id == tasks[1].id]
    with pytest.raises(EpisodeCancelled, match=r"--max-cost 0.2 USD\) is spent: 0.2250 USD"):
        attempt(second, spec.replace(max_cost_usd=0.2))
    assert len(priced_model.requests) == 1
    # the same worker process, the run resumed with a higher budget: the episode runs
    out = attempt(second, spec.replace(max_cost_usd=1.0))
    assert out["termination"] == "submitted" and len(priced_model.requests) == 2
