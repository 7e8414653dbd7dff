"""Budgets that hold across resumes (issue #37): money spent stays counted against the
run, whatever attempt is replaced.

Real HTTP to the scripted model, Docker sandboxes, the real engine and warehouse. Every
reply costs $0.0035 (1,000 prompt + 100 completion tokens at $2.50 / $10 per million); a
sandbox episode of the solver is 4 replies. Before: an episode's stopped (or failed)
attempt was replaced by its re-run, and its paid turns left the count with it, so a run
resumed with the same budget paid again on every resume while `run_cost` showed less
than the budget.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import engine
from engine import RunSpec
from tests.flows.conftest import containers_of, new_run_id, solver, tiny_tasks
from tests.scripted_model import Fault, Reply, ScriptedModel

pytestmark = pytest.mark.usefixtures("sandbox_image")

PRICES = {"scripted": {"input": 2.5, "output": 10.0}}
REPLY_USD = 0.0035


def paid_reply(body: dict, index: int) -> Reply:
    r = solver(body, index)
    r.usage = {"prompt_tokens": 1_000, "completion_tokens": 100}
    return r


def _spec(server: ScriptedModel, wh: Path, rid: str, **kw: Any) -> RunSpec:
    return RunSpec(task_set="tiny", model="scripted", base_url=server.url, mode="sandbox",
                   concurrency=1, durability="flush", warehouse=str(wh), run_id=rid, retries=0,
                   model_retry_window_s=0.0, prices=PRICES, max_steps=6, wall_clock_s=120, **kw)  # fmt: skip


def _rows(wh: Path, sql: str) -> list[tuple[Any, ...]]:
    from warehouse.query import connect

    with connect(wh) as q:
        return q.rows(sql)


def test_a_replaced_attempts_spend_stays_counted_and_a_spent_budget_starts_nothing(tmp_path: Path) -> None:
    wh, rid = tmp_path / "wh", new_run_id("budget-resume")
    tasks = tiny_tasks(1)
    # three paid replies, then the endpoint fails the fourth call: model_error (not graded)
    script = [paid_reply, paid_reply, paid_reply, Fault.server_error(500)]
    with ScriptedModel(script, default=paid_reply, models=("scripted",)) as server:
        first = engine.run(tasks, _spec(server, wh, rid))
        assert first.summary["status"] == "failed" and server.count == 4

        # resumed with a budget of $0.015: $0.0105 is paid; the re-run pays two replies
        # ($0.0175 in all), is stopped at its next turn, and replaces the failed attempt
        second = engine.run(tasks, _spec(server, wh, rid, max_cost_usd=0.015))
        assert second.summary["status"] == "budget_exhausted", second.summary
        assert server.count == 4 + 2
        assert second.summary["budget"]["spent_usd"] == pytest.approx(5 * REPLY_USD)

        # the same budget again, five times: nothing starts, nothing is paid
        for _ in range(5):
            again = engine.run(tasks, _spec(server, wh, rid, max_cost_usd=0.015))
            assert again.summary["status"] == "budget_exhausted", again.summary
            assert again.summary["ran"] == 1 and again.summary["succeeded"] == 0
        assert server.count == 6, f"{server.count - 6} replies paid again by resumes at a spent budget"
        assert "is spent: 0.0175 USD" in (again.summary["cancel_reason"] or "")

        # the record says what the replaced attempt paid; a higher budget finishes the run
        ((replaced, termination, turns),) = _rows(
            wh, f"SELECT replaced, termination, num_turns FROM episodes WHERE run_id = '{rid}'"
        )
        assert (termination, turns) == ("budget_exhausted", 2)
        assert json.loads(replaced) == {"attempts": 1, "turns": 3, "unreported_turns": 0,
                                        "prompt_tokens": 3_000, "completion_tokens": 300,
                                        "cached_tokens": 0, "reasoning_tokens": 0}  # fmt: skip
        done = engine.run(tasks, _spec(server, wh, rid, max_cost_usd=1.0))
        assert done.summary["status"] == "finished" and server.count == 6 + 4
        assert done.summary["budget"]["spent_usd"] == pytest.approx(9 * REPLY_USD)
    # run_cost prices the current attempt; what the replaced ones paid is beside it
    ((cost, replaced_cost, paid),) = _rows(
        wh, f"SELECT cost_usd, replaced_cost_usd, paid_cost_usd FROM run_cost WHERE run_id = '{rid}'"
    )
    assert (cost, replaced_cost, paid) == pytest.approx((4 * REPLY_USD, 5 * REPLY_USD, 9 * REPLY_USD))
    ((replaced,),) = _rows(wh, f"SELECT replaced FROM episodes WHERE run_id = '{rid}'")
    assert json.loads(replaced)["attempts"] == 2 and json.loads(replaced)["turns"] == 5
    assert containers_of(rid) == []
