"""What a model endpoint reports about usage is data, not truth (issue #37).

Real HTTP to the scripted OpenAI-compatible server, the real engine and warehouse
(DuckDB over Parquet), LLM mode (one reply per episode, no sandbox). Before: a negative
`prompt_tokens` made a run's spend go down (both budgets defeated, `run_cost` -$99.99);
no usage at all made both budgets do nothing; 2^64 failed every episode and then every
query on the warehouse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import engine
from engine import RunSpec
from tests.flows.conftest import new_run_id, solver, tiny_tasks
from tests.scripted_model import Reply, ScriptedModel

PRICES = {"scripted": {"input": 2.5, "output": 10.0}}
HONEST = {"prompt_tokens": 1_000, "completion_tokens": 100}  # $0.0035 a reply


def _replying(usage: dict[str, Any]) -> Any:
    def reply(body: dict, index: int) -> Reply:
        r = solver(body, index)
        r.usage = dict(usage)
        return r

    return reply


def _spec(server: ScriptedModel, wh: Path, rid: str, **kw: Any) -> RunSpec:
    return RunSpec(task_set="tiny", model="scripted", base_url=server.url, mode="llm",
                   concurrency=1, durability="flush", warehouse=str(wh), run_id=rid,
                   model_retry_window_s=0.0, prices=PRICES, **kw)  # fmt: skip


def _rows(wh: Path, sql: str) -> list[tuple[Any, ...]]:
    from warehouse.query import connect

    with connect(wh) as q:
        return q.rows(sql)


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("negative", {"prompt_tokens": -10_000_000_000 // 1000, "completion_tokens": 100}),
        ("none", {"note": "no counts"}),
        ("2^64", {"prompt_tokens": 2**64, "completion_tokens": 100}),
        ("boolean", {"prompt_tokens": True, "completion_tokens": 100}),
    ],
)
@pytest.mark.parametrize("flag", ["max_cost_usd", "max_run_tokens"])
def test_a_budget_against_an_endpoint_whose_usage_cannot_be_counted_stops_with_one_sentence(
    tmp_path: Path, name: str, usage: dict[str, Any], flag: str
) -> None:
    wh, rid = tmp_path / "wh", new_run_id(f"lying-{flag[:8]}")
    budget = {"max_cost_usd": 1.0} if flag == "max_cost_usd" else {"max_run_tokens": 1_000_000}
    with ScriptedModel(default=_replying(usage), models=("scripted",)) as server:
        res = engine.run(tiny_tasks(6), _spec(server, wh, rid, **budget))
        paid = server.count
        # the first reply could not be counted: one paid reply, then nothing started
        assert paid == 1, f"{paid} replies paid against a budget that cannot count them"
        s = res.summary
        assert s["status"] == "budget_exhausted", s
        reason = s["cancel_reason"] or ""
        assert "cannot be held" in reason and "reported no usage for 1 turn(s)" in reason, reason
        assert ("--max-cost 1 USD" if flag == "max_cost_usd" else "--max-run-tokens 1000000") in reason
        # a resume with the same budget starts nothing: the recorded turn is still uncounted
        again = engine.run(tiny_tasks(6), _spec(server, wh, rid, **budget))
        assert server.count == paid and again.summary["status"] == "budget_exhausted"
        # without a budget the run goes on (nothing to hold), and every number stays sane
        done = engine.run(tiny_tasks(6), _spec(server, wh, rid))
        assert done.summary["status"] == "finished" and server.count == 6
    (row,) = _rows(wh, f"SELECT cost_usd, known_cost_usd, unpriced_turns, prompt_tokens FROM run_cost "
                       f"WHERE run_id = '{rid}'")  # fmt: skip
    cost, known, unpriced, prompt = row
    assert cost is None and unpriced == 6, row  # unknown, never negative, never 2^64
    assert (known or 0) >= 0 and prompt >= 0, row


def test_an_honest_endpoints_budget_still_counts(tmp_path: Path) -> None:
    """The control: the same budget against bounded counts stops on what was spent."""
    wh, rid = tmp_path / "wh", new_run_id("honest")
    with ScriptedModel(default=_replying(HONEST), models=("scripted",)) as server:
        res = engine.run(tiny_tasks(6), _spec(server, wh, rid, max_cost_usd=0.01))
        assert server.count == 3  # $0.0035 each: the third crosses $0.01
    assert res.summary["status"] == "budget_exhausted"
    assert "is spent: 0.0105 USD" in (res.summary["cancel_reason"] or "")


def test_a_count_of_2_to_the_64_fails_no_episode_and_no_query(tmp_path: Path) -> None:
    """No budget: the episodes are recorded (their usage unknown) and SQL works."""
    wh, rid = tmp_path / "wh", new_run_id("huge")
    usage = {"prompt_tokens": 2**64, "completion_tokens": 2**63, "prompt_tokens_details": {"cached_tokens": -1}}
    with ScriptedModel(default=_replying(usage), models=("scripted",)) as server:
        res = engine.run(tiny_tasks(2), _spec(server, wh, rid))
    assert res.summary["status"] == "finished" and res.summary["succeeded"] == 2, res.summary
    rows = _rows(wh, f"SELECT prompt_tokens, completion_tokens, cached_tokens FROM turns WHERE run_id = '{rid}'")
    assert rows == [(None, None, None)] * 2
