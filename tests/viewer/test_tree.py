"""The viewer's branches page (issue #25): a parent and the episodes forked or replayed from
it, side by side from the branch turn on, over a real warehouse and the real server."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.viewer.conftest import HOSTILE, start_viewer
from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse


def _branch(run: str, parent, sample: int, turn: int, kind: str, says: str):  # type: ignore[no-untyped-def]
    ep, turns = make_episode(run, "t1", sample=sample, turns=5)
    ep = ep.model_copy(update={"parent_run_id": parent.run_id, "parent_episode_id": parent.episode_id,
                               "branch_turn": turn, "branch_kind": kind})  # fmt: skip
    turns = [t.model_copy(update={"assistant_content": f"{says} {t.turn_index}"}) for t in turns]
    return ep, turns


def test_branches_side_by_side(tmp_path: Path) -> None:
    root = tmp_path / "wh"
    w = Warehouse(root).writer(durability="flush")
    parent, pturns = make_episode("pytest-tree", "t1", turns=5)
    pturns = [t.model_copy(update={"assistant_content": f"parent says {t.turn_index}"}) for t in pturns]
    record(w, parent, pturns)
    a, at = _branch("pytest-tree", parent, 1, 2, "fork", "fork A says")
    b, bt = _branch("pytest-tree-replay", parent, 0, 3, "replay", HOSTILE)
    lone, lt = make_episode("pytest-tree", "t2", turns=1)
    for ep, ts in ((a, at), (b, bt), (lone, lt)):
        record(w, ep, ts)
    w.close()
    srv = start_viewer(root)
    try:
        # from a branch, the page shows its parent and both branches
        page = httpx.get(srv.url + f"/tree?ep=pytest-tree/{a.episode_id}")
        assert page.status_code == 200, page.text
        html = page.text
        sides = re.findall(r'data-episode="([0-9a-f]+)"', html)
        assert sides == [parent.episode_id, a.episode_id, b.episode_id]
        assert "fork at turn 2" in html and "replay at turn 3" in html
        # from the earliest branch turn (2) on; turns 0-1 are not shown
        assert "parent says 1" not in html and "parent says 2" in html and "parent says 4" in html
        assert "fork A says 2" in html and "fork A says 4" in html
        # the replay's turn 2 is the parent's (before its branch turn): marked, not repeated
        assert html.count('data-shared="2"') == 1
        assert "<script>window.__pwned" not in html and "&lt;script&gt;" in html  # escaped
        # the episode page links to it and names the lineage
        ep_page = httpx.get(srv.url + f"/runs/pytest-tree-replay/episodes/{b.episode_id}").text
        assert 'data-testid="tree-link"' in ep_page and "at turn 3 (depth 1)" in ep_page
        assert 'data-testid="lineage"' not in httpx.get(srv.url + f"/runs/pytest-tree/episodes/{lone.episode_id}").text
        # an episode without branches, and a bad reference, say so
        r = httpx.get(srv.url + f"/tree?ep=pytest-tree/{lone.episode_id}")
        assert r.status_code == 404 and "was never forked or replayed" in r.text
        r = httpx.get(srv.url + "/tree?ep=nope")
        assert r.status_code == 400 and "RUN/EPISODE" in r.text
    finally:
        srv.stop()
