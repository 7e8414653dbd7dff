"""A rollout batch's budget (issue #28, docs/cost.md): real rollout server, sandboxes,
warehouse, and HTTP to a scripted policy whose every reply reports 102,000 tokens
($0.225 at tests/flows/test_cost.py's prices). An episode is 2 turns (write the answer,
submit): $0.45. One episode at a time, a budget of $0.50: the first episode finishes,
the second stops after its first turn ($0.675 spent), the other two never start."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from rl.client import RolloutClient, RolloutServerError
from tests.flows.test_cost import PRICES, TURN_USD, USAGE
from tests.rl.conftest import (
    containers_of,
    new_run_id,
    read_episodes,
    read_turns,
    rollout_server,
    status_of,
)
from tests.rl.test_server import answering, request
from tests.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.usefixtures("sandbox_image")


def priced(body: dict, index: int) -> Reply:
    reply = answering(itertools.repeat("42"))(body, index)
    assert isinstance(reply, Reply)
    reply.usage = dict(USAGE)
    return reply


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with RolloutClient(url) as client:
        return list(client.stream(body))


def test_a_batch_stops_on_its_budget_and_the_trainer_gets_no_reward_for_it(tmp_path: Path) -> None:
    from warehouse.query import connect

    wh, rid = tmp_path / "wh", new_run_id("budget")
    with ScriptedModel(default=priced, models=("scripted",)) as model, rollout_server(wh, prices=PRICES) as (url, _):
        body = request(model, rid, n=4, max_concurrency=1, budget={"max_cost_usd": 0.5})
        events = _events(url, body)
        assert len(model.requests) == 3  # 2 turns of the first episode, 1 of the second
        trajectories = [e for e in events if e["type"] == "trajectory"]
        ok = [t for t in trajectories if t["status"] == "ok"]
        stopped = [t for t in trajectories if t["status"] == "cancelled"]
        assert len(ok) == 1 and ok[0]["reward"] == 1.0 and ok[0]["num_turns"] == 2
        assert len(stopped) == 3
        assert {t["termination"] for t in stopped} == {"budget_exhausted"}
        assert all(t["reward"] is None and "messages" not in t for t in stopped)
        assert "--max-cost 0.5 USD" in stopped[0]["reason"]
        done = events[-1]
        assert done["type"] == "done" and done["stopped"] == "budget_exhausted"
        assert (done["ok"], done["cancelled"], done["failed"]) == (1, 3, 0)
        assert done["budget"]["spent_usd"] == pytest.approx(3 * TURN_USD)
        assert done["budget"]["spent_tokens"] == 3 * 102_000 and done["budget"]["exhausted"]

        # the warehouse: the run is marked, the stopped episode kept its paid turn, only
        # the finished episode is scored, and run_cost prices it with the recorded table
        assert status_of(wh, rid) == "budget_exhausted"
        eps = sorted((e["termination"], e["num_turns"]) for e in read_episodes(wh, rid))
        assert eps == [("budget_exhausted", 1), ("submitted", 2)]
        assert len(read_turns(wh, rid)) == 3
        with connect(wh) as q:
            assert q.rows(f"SELECT count(*) FROM scores WHERE run_id = '{rid}'") == [(1,)]
            (usd,) = q.rows(f"SELECT cost_usd FROM run_cost WHERE run_id = '{rid}'")[0]
            assert usd == pytest.approx(3 * TURN_USD)
            (notes,) = q.rows(f"SELECT notes FROM runs WHERE run_id = '{rid}'")[0]
            assert "budget" in notes and "--max-cost 0.5 USD" in notes
        assert containers_of(rid) == []

        # the same run again with the same budget: the warehouse already holds $0.675, so
        # nothing starts (the budget counts what the warehouse holds, not this batch's memory)
        again = _events(url, body)
        assert len(model.requests) == 3
        assert [e["termination"] for e in again if e["type"] == "trajectory"] == ["budget_exhausted"] * 4
        assert again[-1]["stopped"] == "budget_exhausted"


def test_a_cost_budget_without_a_price_is_refused_before_any_work(tmp_path: Path) -> None:
    wh, rid = tmp_path / "wh", new_run_id("budget-unpriced")
    with ScriptedModel(default=priced, models=("scripted",)) as model, rollout_server(wh) as (url, _):
        with pytest.raises(RolloutServerError) as err:
            _events(url, request(model, rid, n=1, budget={"max_cost_usd": 1.0}))
        assert "(422)" in str(err.value) and "no price for model 'scripted'" in str(err.value)
        assert model.requests == [] and read_episodes(wh, rid) == []
