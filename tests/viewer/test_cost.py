"""Cost in the viewer (issue #28): the runs list and the run page show each run's
cost_usd from `run_cost` (priced with the table the run recorded), and "unknown" when
the model has no price, never 0. Real records in real Parquet, the real server."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.viewer.conftest import start_viewer
from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse

# factory turns: prompt 100 + 10 i tokens (90 cached), completion 20. At $1000 / $500 /
# $4000 per million a turn costs (10 + 10 i) * 1000 + 90 * 500 + 20 * 4000 = $0.135 + $0.01 i:
# 3 turns $0.435, an episode of 2 sandbox + 1 of 1 turn = $0.435 + $0.135 = $0.57.
PRICES = {"scripted-model": {"input": 1000.0, "cached_input": 500.0, "output": 4000.0}}


def test_the_runs_list_and_the_run_page_show_cost_or_unknown(tmp_path: Path) -> None:
    root = tmp_path / "wh"
    wh = Warehouse(root)
    wh.write_run("view-priced", model="scripted-model", config={"prices": PRICES})
    wh.write_run("view-unpriced", model="scripted-model", config={"prices": {"other": {"input": 1, "output": 1}}})
    with wh.writer(durability="flush") as w:
        for rid in ("view-priced", "view-unpriced"):
            for task, n in (("t1", 3), ("t2", 1)):
                ep, turns = make_episode(rid, task, turns=n)
                record(w, ep, turns)
    for rid in ("view-priced", "view-unpriced"):
        wh.finish_run(rid)
    srv = start_viewer(root)
    try:
        page = httpx.get(srv.url + "/").text
        cells = dict(re.findall(r'data-cost="([^"]+)"[^>]*>([^<]*)</td>', page))
        assert cells == {"view-priced": "$0.5700", "view-unpriced": "unknown"}, cells
        priced = httpx.get(srv.url + "/runs/view-priced").text
        fact = re.search(r'data-testid="cost"><b>cost</b> ([^<]*)</span>', priced)
        assert fact and fact.group(1).strip() == "$0.5700 ($0.2850 per episode)", fact
        assert "430 in (360 cached) / 80 out" in priced.replace(",", "")
        unpriced = httpx.get(srv.url + "/runs/view-unpriced").text
        fact = re.search(r'data-testid="cost"><b>cost</b> ([^<]*)</span>', unpriced)
        assert fact and fact.group(1).strip() == "unknown (4 turn(s) without a price)", fact
        assert "$0.0000" not in unpriced
    finally:
        srv.stop()
