"""A real run in the viewer: `sandflow bench` with the scripted model through the real
pipeline (Prefect, Docker, the warehouse), then read in the browser: the episode's turns
are the commands the model sent and the outputs the sandbox gave back; and the report
written by `sandflow flows report --viewer-url` opens the viewer from its tables."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.flows.conftest import docker_image, model, tiny_tasks, write_tasks  # noqa: F401
from tests.scripted_model import ScriptedModel
from tests.viewer.conftest import shot, start_viewer

pytestmark = [
    pytest.mark.browser,
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.usefixtures("prefect_harness", "docker_image"),
]


def test_real_run_read_in_the_browser(tmp_path: Path, model: ScriptedModel, page: Any) -> None:  # noqa: F811
    from sandflow.cli import app

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(2))
    wh = tmp_path / "wh"
    runner = CliRunner(env={"COLUMNS": "300"})
    res = runner.invoke(
        app,
        ["bench", "--suite", str(ts), "--base-url", model.url, "--model", "scripted",
         "--warehouse", str(wh), "--concurrency", "2", "--max-steps", "6"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output + repr(res.exception)
    run_id = re.search(r"run (\S+): 4 episodes recorded", res.output)
    assert run_id, res.output
    run = run_id.group(1)

    srv = start_viewer(wh)
    try:
        page.goto(srv.url + "/")
        page.click(f"a[data-run='{run}']")
        page.wait_for_url(re.compile(f"/runs/{re.escape(run)}$"))
        assert page.locator("[data-testid=episodes] tbody tr").count() == 4
        acc = page.locator("[data-testid=accuracy]").inner_text()
        assert "100%" in acc
        shot(page, "1-run")
        page.locator('[data-testid=episodes] a[data-task="t0"][data-mode="sandbox"]').click()
        page.wait_for_url(re.compile("/episodes/"))
        turns = page.locator("[data-testid=turns] article.turn")
        assert turns.count() == 4  # ls + cat, compute, view, submit
        t0, t1, t2 = (page.locator(f"#turn-{i}").inner_text() for i in range(3))
        assert "cat /testbed/documents/notes.txt" in t0 and "note 0" in t0  # the sandbox's output
        assert "python3 -c 'print(6*7)' > /testbed/output/answer.txt" in t1
        assert "computation" in t1  # the usage flow's label
        assert "view /testbed/output/answer.txt" in t2 and "42" in t2
        assert "submit" in page.locator("#turn-3").inner_text()
        summary = page.locator("[data-testid=episode-summary]").inner_text()
        assert "submitted" in summary and "42" in summary
        assert page.locator("[data-testid=scores] .verdict.correct").count() >= 1
        shot(page, "2-episode")
        page.locator("[data-testid=compare-links] a", has_text="this run: llm").click()
        page.wait_for_url(re.compile("/compare"))
        assert page.locator("table.sbs-turns tbody tr").count() == 4
        shot(page, "3-side-by-side")

        # the report, written with this viewer's address, links into it
        out = tmp_path / "report"
        res = runner.invoke(
            app,
            ["flows", "report", "-r", run, "--warehouse", str(wh), "--out", str(out), "--viewer-url", srv.url],
        )  # fmt: skip
        assert res.exit_code == 0, res.output + repr(res.exception)
        page.goto((out / "report.html").as_uri())
        link = page.locator("table[data-table=accuracy] tbody tr").filter(has_text="sandbox").locator("a").first
        link.click()
        page.wait_for_url(re.compile(rf"{re.escape(srv.url)}/runs/{re.escape(run)}\?"))
        assert "mode=sandbox" in page.url
        assert page.locator("[data-testid=episodes] tbody tr").count() == 2
        shot(page, "4-from-report")
        assert page.errors == []
    finally:
        srv.stop()
