"""The viewer in a real browser: headless Debian Chromium, driven by Playwright, clicking
through the real server over a warehouse of real records. Screenshots are kept in
test-artifacts/viewer/<test>/."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.viewer.conftest import (
    FAKE_KEY,
    HOSTILE,
    LATE_SECRET,
    RUN_A,
    RUN_B,
    ViewerServer,
    shot,
    start_viewer,
)

pytestmark = pytest.mark.browser


def _rows(page: Any, testid: str) -> int:
    return page.locator(f"[data-testid={testid}] tbody tr").count()


def _episode_link(page: Any, task: str, mode: str) -> Any:
    return page.locator(f'[data-testid=episodes] a[data-task="{task}"][data-mode="{mode}"]')


def test_runs_episode_turn(viewer: ViewerServer, page: Any) -> None:
    page.goto(viewer.url + "/")
    assert page.locator(f"a[data-run={RUN_A}]").is_visible()
    assert page.locator(f"a[data-run={RUN_B}]").is_visible()
    shot(page, "1-runs")

    page.click(f"a[data-run={RUN_A}]")
    page.wait_for_url(re.compile(f"/runs/{RUN_A}$"))
    assert _rows(page, "accuracy") == 4  # chemistry x 2 modes, math x 2 modes
    assert _rows(page, "episodes") == 7  # 3 tasks x 2 modes + the hostile one
    shot(page, "2-run")

    # filters: domain, score, usage (a form submit, as a user would)
    page.select_option("select[name=domain]", "math")
    page.select_option("select[name=score]", "correct")
    page.click("form[data-testid=filters] button[type=submit]")
    page.wait_for_url(re.compile(r"domain=math"))
    assert _rows(page, "episodes") == 2  # task-0 in both modes
    page.select_option("select[name=usage]", "computation")
    page.click("form[data-testid=filters] button[type=submit]")
    page.wait_for_url(re.compile(r"usage=computation"))
    assert _rows(page, "episodes") == 1
    shot(page, "3-filtered")
    page.select_option("select[name=usage]", "")
    page.select_option("select[name=score]", "")
    page.select_option("select[name=termination]", "max_steps")
    page.select_option("select[name=domain]", "")
    page.click("form[data-testid=filters] button[type=submit]")
    page.wait_for_url(re.compile(r"termination=max_steps"))
    assert _rows(page, "episodes") == 1

    page.goto(viewer.url + f"/runs/{RUN_A}")
    _episode_link(page, "task-0", "sandbox").click()
    page.wait_for_url(re.compile(f"/runs/{RUN_A}/episodes/"))
    summary = page.locator("[data-testid=episode-summary]")
    assert "submitted" in summary.inner_text()
    assert "42" in page.locator(".answer-box").inner_text()
    scores = page.locator("[data-testid=scores]").inner_text()
    assert "exact" in scores and "matches the ground truth" in scores
    turns = page.locator("[data-testid=turns] article.turn")
    assert turns.count() == 3
    t1 = page.locator("#turn-1")
    text = t1.inner_text()
    assert "python3 -c 'print(1 * 7)'" in text  # the tool call's argument
    assert "execute_bash" in text and "exit 0" in text
    assert "computation" in text  # its usage label
    assert "110 in" in text and "20 out" in text  # tokens of the turn
    assert "model 500 ms" in text  # timing
    assert t1.locator("pre.out").first.inner_text().strip() == "7"  # the observation
    page.click("#turn-2 a.turn-no")
    page.wait_for_url(re.compile("#turn-2$"))
    shot(page, "4-episode")
    assert page.errors == []


def test_hostile_text_stays_text(
    viewer: ViewerServer, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDFLOW_API_KEY", LATE_SECRET)
    page.goto(viewer.url + f"/runs/{RUN_A}?task=hostile")
    assert _rows(page, "episodes") == 1
    page.locator("[data-testid=episodes] a[data-episode]").click()
    page.wait_for_url(re.compile("/episodes/"))
    page.click("[data-action=expand-all]")
    assert page.evaluate("window.__pwned") is None
    assert page.locator("script").count() == 1  # viewer.js, nothing from the data
    assert page.locator("main img").count() == 0
    assert page.locator("main b:text-is('bold?')").count() == 0
    body = page.locator("main").inner_text()
    assert "<script>window.__pwned = 1</script>" in body  # shown, as text
    assert body.count('onerror="window.__pwned = 2"') >= 4  # answer, text, reasoning, output...
    html = page.content()
    assert FAKE_KEY not in html and LATE_SECRET not in html
    assert "***" in body
    # the long output is folded, and unfolds
    out = page.locator("#turn-1 section.call").first
    assert "line 0:" in out.inner_text()
    fold = out.locator("details.fold")
    assert "more line(s)" in fold.locator("summary").inner_text()
    page.click("[data-action=collapse-all]")
    assert not out.locator("details.fold pre").is_visible()
    fold.locator("summary").click()
    assert "line 399:" in out.locator("details.fold pre").inner_text()
    t1 = page.locator("#turn-1").inner_text()
    assert "str_replace /testbed/output/answer.txt" in t1 and "new_str" in t1
    assert "arguments are not valid JSON" in t1 and "invalid JSON arguments" in t1
    shot(page, "hostile-episode")
    # the same text through the SQL box
    page.goto(viewer.url + "/sql?q=" + "SELECT answer FROM episodes WHERE task_id = 'task-hostile'")
    assert HOSTILE[:30] in page.locator("[data-testid=sql-result]").inner_text()
    assert page.evaluate("window.__pwned") is None
    shot(page, "hostile-sql")
    assert page.errors == []


def test_side_by_side(viewer: ViewerServer, page: Any) -> None:
    page.goto(viewer.url + f"/runs/{RUN_A}")
    _episode_link(page, "task-1", "sandbox").click()
    page.wait_for_url(re.compile("/episodes/"))
    links = page.locator("[data-testid=compare-links] a")
    assert links.count() == 3  # this run's llm episode, and run B's two
    page.locator("[data-testid=compare-links] a", has_text="this run: llm").click()
    page.wait_for_url(re.compile("/compare"))
    sides = page.locator("[data-testid=side-by-side] .sbs-head .side")
    assert sides.count() == 2
    assert "sandbox" in sides.nth(0).inner_text() and "llm" in sides.nth(1).inner_text()
    assert "task-1" in sides.nth(0).inner_text() and "task-1" in sides.nth(1).inner_text()
    rows = page.locator("table.sbs-turns tbody tr")
    assert rows.count() == 3  # sandbox: 3 turns; llm: 1 (two rows show 'no turn')
    assert "no turn 1" in rows.nth(1).inner_text()
    shot(page, "1-side-by-side-modes")

    # two runs, task by task: run A vs run B, only the pairs whose verdicts differ
    page.goto(viewer.url + "/compare-runs")
    page.select_option("select[name=a]", RUN_A)
    page.select_option("select[name=b]", RUN_B)
    page.select_option("select[name=only]", "differ")
    page.click("form[data-testid=compare-form] button[type=submit]")
    page.wait_for_url(re.compile("only=differ"))
    stats = page.locator("[data-testid=compare-stats]").inner_text()
    assert re.search(r"pairs\s+7", stats), stats  # 6 shared + the hostile one (A only)
    assert _rows(page, "pairs") == 7  # every shared task flipped, and the A-only one
    shot(page, "2-compare-runs")
    page.locator("[data-testid=side-by-side-link]").first.click()
    page.wait_for_url(re.compile("/compare\\?"))
    heads = page.locator("[data-testid=side-by-side] .sbs-head .side h2")
    assert RUN_A in heads.nth(0).inner_text() and RUN_B in heads.nth(1).inner_text()
    shot(page, "3-side-by-side-runs")
    assert page.errors == []


def test_sql_box(viewer: ViewerServer, page: Any) -> None:
    page.goto(viewer.url + "/sql")
    page.fill(
        "form.sql textarea",
        "SELECT run_id, episode_id, turn_index, command FROM tool_calls\n"
        f"WHERE run_id = '{RUN_A}' AND command LIKE 'python3%' ORDER BY episode_id, turn_index",
    )
    page.press("form.sql textarea", "Control+Enter")
    page.wait_for_url(re.compile(r"/sql\?q="))
    result = page.locator("[data-testid=sql-result]")
    assert result.locator("tbody tr").count() == 9  # 3 sandbox episodes x 3 turns
    shot(page, "1-sql")
    second = result.locator("tbody tr").nth(1)
    eid = second.locator("td").nth(2).inner_text()
    second.locator("a.row-link").click()
    page.wait_for_url(re.compile(f"/runs/{RUN_A}/episodes/{eid}#turn-1$"))
    assert page.locator("#turn-1").is_visible()
    shot(page, "2-sql-row-opened")
    # read-only: writes and host files are refused with a clear message
    for sql, says in [
        ("COPY (SELECT 1) TO '/tmp/viewer-pwned.csv'", "read-only"),
        ("SELECT * FROM read_text('/etc/passwd')", "Permission"),
        ("DROP VIEW turns", "read-only"),
        ("SELECT 1; SELECT 2", "one statement"),
    ]:
        page.goto(viewer.url + "/sql")
        page.fill("form.sql textarea", sql)
        page.click("form.sql button[type=submit]")
        page.wait_for_selector("[data-testid=sql-error]")
        assert says in page.locator("[data-testid=sql-error]").inner_text(), sql
    assert not Path("/tmp/viewer-pwned.csv").exists()
    page.goto(viewer.url + f"/runs/{RUN_A}")
    assert _rows(page, "episodes") == 7  # the views are all still there
    assert page.errors == []


def test_live_run_updates(tmp_path: Path, page: Any) -> None:
    """A run being recorded: its page and the live episode's page follow the journal."""
    from tests.warehouse.factory import make_episode
    from warehouse import Warehouse

    root = tmp_path / "wh"
    wh = Warehouse(root)
    run = "pytest-view-live"
    wh.write_run(run, model="m", dataset="tiny")
    w = wh.writer(durability="flush")
    ep, turns = make_episode(run, "live-task", turns=3)
    w.start_episode(ep.model_copy(update={"termination": None, "ended_at": None, "num_turns": 0}))
    w.record_turn(turns[0])
    srv = start_viewer(root, refresh_s=0.2)
    try:
        page.goto(srv.url + f"/runs/{run}")
        live = page.locator("[data-testid=live-episodes]")
        assert live.locator("tbody tr").count() == 1
        assert "live" in live.inner_text()
        page.goto(srv.url + f"/runs/{run}/episodes/{ep.episode_id}")
        assert page.locator("[data-testid=partial-summary]").is_visible()
        assert page.locator("article.turn").count() == 1
        w.record_turn(turns[1])
        page.wait_for_selector("#turn-1", timeout=15_000)  # no reload: the page polls
        shot(page, "1-live-episode")
        w.record_turn(turns[2])
        w.finish_episode(ep)
        # the episode is committed: the page reloads into the finished episode
        page.wait_for_selector("[data-testid=episode-summary]", timeout=15_000)
        assert page.locator("article.turn").count() == 3
        assert "submitted" in page.locator("[data-testid=episode-summary]").inner_text()
        shot(page, "2-finished-episode")
        wh.finish_run(run)
        page.goto(srv.url + f"/runs/{run}")
        deadline = time.monotonic() + 10
        while _rows(page, "episodes") != 1 and time.monotonic() < deadline:
            page.reload()
        assert _rows(page, "episodes") == 1
        assert page.locator("[data-testid=live-episodes]").count() == 0
        assert page.errors == []
    finally:
        w.close()
        srv.stop()
