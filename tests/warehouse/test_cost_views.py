"""The cost views on hand-made records (warehouse/cost.py): the edges a real run rarely
shows. Real DuckDB over real Parquet files; no model, no sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.pricing import load_prices
from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse
from warehouse.query import connect

PRICES = {"scripted-model": {"input": 1.0, "cached_input": 0.5, "output": 4.0}}


def _wh(tmp_path: Path, run_id: str, prices: dict | None) -> Path:
    root = tmp_path / "wh"
    wh = Warehouse(root)
    wh.write_run(run_id, model="scripted-model", config={"prices": prices} if prices else {})
    return root


def test_turn_prices_follow_the_usage_object(tmp_path: Path) -> None:
    # factory turns: prompt 100 + 10 i (90 cached), completion 20, no reasoning
    root = _wh(tmp_path, "r1", PRICES)
    ep, turns = make_episode("r1", "t1", turns=3)
    with Warehouse(root).writer() as w:
        record(w, ep, turns)
    with connect(root) as q:
        costs = [c for (c,) in q.rows("SELECT cost_usd FROM turn_cost ORDER BY turn_index")]
        expect = [((100 + 10 * i - 90) * 1.0 + 90 * 0.5 + 20 * 4.0) / 1e6 for i in range(3)]
        assert costs == pytest.approx(expect)
        (usd,) = q.rows("SELECT cost_usd FROM run_cost WHERE run_id = 'r1'")[0]
        assert usd == pytest.approx(sum(expect))


def test_an_episode_with_tokens_but_no_turns_is_unknown(tmp_path: Path) -> None:
    root = _wh(tmp_path, "r2", PRICES)
    ep, _ = make_episode("r2", "t1", turns=0)
    ep = ep.model_copy(update={"prompt_tokens": 5000, "completion_tokens": 300})
    with Warehouse(root).writer() as w:
        record(w, ep, [])
    quiet, _ = make_episode("r2", "t2", turns=0)  # no turns and no tokens: priced, costs 0
    with Warehouse(root).writer() as w:
        record(w, quiet, [])
    with connect(root) as q:
        rows = q.rows("SELECT task_id, prompt_tokens, cost_usd FROM episode_cost ORDER BY task_id")
        assert rows == [("t1", 5000, None), ("t2", 0, 0.0)]
        assert q.rows("SELECT cost_usd, unpriced_episodes FROM run_cost") == [(None, 1)]


def test_a_run_without_prices_and_a_broken_recorded_table(tmp_path: Path) -> None:
    root = _wh(tmp_path, "r3", None)
    Warehouse(root).write_run("r4", model="scripted-model", config={"prices": {"scripted-model": {"input": -1}}})
    for rid in ("r3", "r4"):
        ep, turns = make_episode(rid, "t1", turns=2)
        with Warehouse(root).writer() as w:
            record(w, ep, turns)
    with connect(root) as q:
        assert q.rows("SELECT run_id, cost_usd, unpriced_turns FROM run_cost ORDER BY run_id") == [
            ("r3", None, 2),
            ("r4", None, 2),
        ]
    with connect(root, prices=load_prices(PRICES)) as q:  # a session table prices both
        assert [u is not None for (u,) in q.rows("SELECT cost_usd FROM run_cost")] == [True, True]
        assert q.rows("SELECT DISTINCT price_source FROM turn_cost") == [("session",)]


def test_a_branchs_inherited_turns_are_paid_once(tmp_path: Path) -> None:
    """A replayed or forked episode records its parent's turns before its branch turn (issue
    #25); the parent paid for them: the branch's cost counts only its own turns."""
    root = _wh(tmp_path, "r5", PRICES)
    parent, pturns = make_episode("r5", "t1", turns=3)
    child, cturns = make_episode("r5", "t1", sample=1, turns=3)
    child = child.model_copy(update={"parent_episode_id": parent.episode_id, "branch_turn": 2,
                                     "branch_kind": "replay"})  # fmt: skip
    with Warehouse(root).writer() as w:
        record(w, parent, pturns)
        record(w, child, cturns)
    with connect(root) as q:
        rows = q.rows(f"SELECT turn_index, inherited, cost_usd > 0 FROM turn_cost "
                      f"WHERE episode_id = '{child.episode_id}' ORDER BY turn_index")  # fmt: skip
        assert rows == [(0, True, False), (1, True, False), (2, False, True)]
        ((p_usd,), (c_usd,)) = q.rows("SELECT cost_usd FROM episode_cost ORDER BY sample_index")
        assert (p_usd, c_usd) == pytest.approx((435e-6, 155e-6))  # the child: its turn 2 only


def test_the_budgets_sql_sums_price_to_the_per_turn_costs(tmp_path: Path) -> None:
    # engine/budget.py counts a run's spend from warehouse.cost.token_sums (one aggregate):
    # Price.cost of the sums must equal the sum of the turns' costs, per-turn clamps and a
    # turn without usage included.
    from tasks.records import Usage
    from warehouse.cost import token_sums

    root = _wh(tmp_path, "r9", PRICES)
    ep, turns = make_episode("r9", "t1", turns=4)
    turns[1] = turns[1].model_copy(  # more cached than prompt: clamped per turn
        update={"usage": turns[1].usage.model_copy(update={"cached_tokens": 10_000})}
    )
    turns[2] = turns[2].model_copy(update={"usage": Usage()})  # the server reported none
    with Warehouse(root).writer() as w:
        record(w, ep, turns)
    price = load_prices(PRICES).lookup("scripted-model", None)
    assert price is not None
    with connect(root) as q:
        tokens, prompt, completion, cached, reasoning = token_sums(q, "r9")
        (per_turn,) = q.rows("SELECT sum(cost_usd) FROM turn_cost WHERE run_id = 'r9'")[0]
        (all_tokens,) = q.rows(
            "SELECT sum(coalesce(prompt_tokens, 0) + coalesce(completion_tokens, 0)) FROM turns"
        )[0]
    assert tokens == all_tokens and cached <= prompt
    assert price.cost(prompt, completion, cached, reasoning) == pytest.approx(per_turn)
