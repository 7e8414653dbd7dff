"""The static report's tables link into the viewer: a click on a cell of report.html
(opened from disk in Chromium) lands on the episodes behind it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from analysis.report import ReportData, to_html, viewer_link, write_report
from tests.viewer.conftest import RUN_A, ViewerServer, shot


def _report(root: Path, viewer_url: str | None) -> ReportData:
    from warehouse import Warehouse

    rd = ReportData.from_run(Warehouse(root).load_run(RUN_A), {"model": "m"})
    rd.viewer_url = viewer_url
    return rd


def test_links_name_the_cells_episodes() -> None:
    row = {"domain": "math", "mode": "sandbox", "episodes": 3, "accuracy": 50.0, "computation": 40.0}
    base = "http://127.0.0.1:9/x/"
    assert viewer_link(base, "r1", row, "accuracy") == "http://127.0.0.1:9/x/runs/r1?domain=math&mode=sandbox"
    assert viewer_link(base, "r1", row, "computation") == (
        "http://127.0.0.1:9/x/runs/r1?domain=math&mode=sandbox&usage=computation"
    )
    assert viewer_link(base, "r1", {"domain": "(all)", "mode": "llm", "episodes": 1}, "episodes") == (
        "http://127.0.0.1:9/x/runs/r1?mode=llm"
    )
    assert viewer_link(base, "r1", row, "avg_turns") is None


def test_report_without_viewer_has_no_links(warehouse_root: Path) -> None:
    page = to_html(_report(warehouse_root, None))
    assert "/runs/" not in page


@pytest.mark.browser
def test_report_cell_opens_the_viewer(
    warehouse_root: Path, viewer: ViewerServer, page: Any, tmp_path: Path
) -> None:
    html_path, _ = write_report(_report(warehouse_root, viewer.url), tmp_path / "report")
    page.goto(html_path.as_uri())
    cell = page.locator("table[data-table=accuracy] tbody tr").filter(has_text="chemistry").filter(
        has_text="sandbox"
    ).locator("a").first
    shot(page, "1-report")
    cell.click()
    page.wait_for_url(re.compile(rf"/runs/{RUN_A}\?"))
    assert "domain=chemistry" in page.url and "mode=sandbox" in page.url
    assert page.locator("[data-testid=episodes] tbody tr").count() == 1
    shot(page, "2-viewer-from-report")
