"""Cost in the nightly trend and the cost rule of --fail-on-regression (issue #28,
docs/cost.md): two nights of one series recorded as real Parquet, read back through
DuckDB (`episode_cost`, priced by each run's recorded table) into the report section."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from analysis import nightly_report as nr
from tests.warehouse.factory import T0, make_episode, record
from warehouse import Warehouse

# factory turns: prompt 100 + 10 i (90 cached), completion 20; at these rates a turn costs
# $0.135 + $0.01 i: a 1-turn episode $0.135, a 3-turn one $0.435.
PRICES = {"scripted-model": {"input": 1000.0, "cached_input": 500.0, "output": 4000.0}}


def _night(root: Path, run_id: str, day: int, turns: dict[str, int], prices: dict | None = PRICES,
           mode: str = "sandbox") -> None:
    wh = Warehouse(root)
    wh.write_run(run_id, model="scripted-model", dataset="tiny", dataset_hash="h1", series="nightly-cost",
                 started_at=T0 + timedelta(days=day), config={"prices": prices} if prices else {})  # fmt: skip
    with wh.writer(durability="flush") as w:
        for task, n in turns.items():
            ep, recs = make_episode(run_id, task, turns=n, mode=mode)
            record(w, ep, recs)
    wh.finish_run(run_id, status="finished")


def test_cost_per_task_is_compared_plotted_and_fails_past_the_limit(tmp_path: Path) -> None:
    root = tmp_path / "wh"
    _night(root, "cost-n1", 0, {"t1": 1, "t2": 1})
    # tonight t1 takes 3 turns; t3 is new (left out of the comparison: the previous run lacks it)
    _night(root, "cost-n2", 1, {"t1": 3, "t2": 1, "t3": 1})
    data = Warehouse(root).series("cost-n2")
    by = {(r["run_id"], r["task_id"]): r["cost_usd"] for r in data.cost}
    assert by[("cost-n1", "t1")] == pytest.approx(0.135) and by[("cost-n2", "t1")] == pytest.approx(0.435)

    sec = nr.build_section(data, max_cost_increase=50)
    (c,) = sec.cost
    assert (c.mode, c.tasks, c.tasks_left_out) == ("sandbox", 2, 1)
    assert c.before == pytest.approx(0.135) and c.after == pytest.approx((0.435 + 0.135) / 2)
    assert c.change_pct == pytest.approx(100 * (0.285 - 0.135) / 0.135)  # +111.1%
    assert c.is_regression
    msg = sec.regression_message()
    assert msg == ("cost per task rose since run cost-n1: sandbox: cost per task $0.1350 -> "
                   "$0.2850 (+111.1%, above +50%, 2 tasks)")  # fmt: skip
    assert "▲ sandbox: cost per task $0.1350 -> $0.2850" in nr.to_markdown(sec)
    page = nr.to_html(sec)
    assert "data-table='cost'" in page.replace('"', "'") and 'data-plot="Cost trend"' in page
    # the trend's points: the mean over every task of the run
    assert sec.cost_trend[("cost-n1", "sandbox")] == pytest.approx(0.135)
    assert sec.cost_trend[("cost-n2", "sandbox")] == pytest.approx((0.435 + 0.135 + 0.135) / 3)

    # within the limit, or no limit: reported, not a regression
    assert nr.build_section(data, max_cost_increase=120).regression_message() is None
    loose = nr.build_section(data)
    assert loose.regression_message() is None and loose.cost[0].describe().startswith("sandbox: cost per task")


def test_an_unpriced_night_is_unknown_never_free(tmp_path: Path) -> None:
    root = tmp_path / "wh"
    _night(root, "cost-u1", 0, {"t1": 1})
    _night(root, "cost-u2", 1, {"t1": 3}, prices={"another-model": {"input": 1, "output": 1}})
    sec = nr.build_section(Warehouse(root).series("cost-u2"), max_cost_increase=0)
    (c,) = sec.cost
    assert (c.tasks, c.tasks_left_out, c.before, c.after) == (0, 1, None, None)
    assert not c.is_regression and sec.regression_message() is None
    assert c.describe() == "sandbox: cost per task unknown (no task priced in both runs)"
    assert sec.cost_trend[("cost-u2", "sandbox")] is None  # a gap in the plot, not a 0


def test_from_a_free_run_any_cost_is_a_rise() -> None:
    c = nr.CostChange("llm", 3, 0, 0.0, 0.01, max_increase_pct=1000)
    assert c.is_regression and c.change_pct is None and "(from free, above +1000%" in c.describe()
    assert not nr.CostChange("llm", 3, 0, 0.0, 0.0, max_increase_pct=0).is_regression


@pytest.mark.usefixtures("prefect_harness")
def test_the_report_flow_returns_the_cost_regression_that_fails_bench(tmp_path: Path) -> None:
    """What `bench --fail-on-regression --max-cost-increase` reads (flows.nightly.benchmark
    raises RegressionFound on `regression`), through the real report flow."""
    from flows.report import report_flow

    root = tmp_path / "wh"
    _night(root, "cost-r1", 0, {"t1": 1, "t2": 1})
    _night(root, "cost-r2", 1, {"t1": 3, "t2": 1})
    out = report_flow(run_id="cost-r2", warehouse=str(root), max_cost_increase=50, viewer_url=None)
    assert out["regression"] and out["regression"].startswith("cost per task rose since run cost-r1")
    assert out["cost_changes"] == [{"mode": "sandbox", "tasks": 2, "tasks_left_out": 0, "before_usd": 0.135,
                                    "after_usd": 0.285, "change_pct": 111.1, "regression": True}]  # fmt: skip
    md = Path(out["markdown"]).read_text()
    assert "**Cost per task**" in md and "▲ sandbox: cost per task $0.1350 -> $0.2850" in md
    assert report_flow(run_id="cost-r2", warehouse=str(root), viewer_url=None)["regression"] is None
