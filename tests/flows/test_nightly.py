"""Two nights of `sandflow bench` against a scripted model whose accuracy changes by a
known amount: the second night finds exactly the planted flips, calls out only the
significant change, links the flipped tasks to their trajectories, and with
--fail-on-regression exits non-zero and fails the Prefect flow run.

Real parts: the session's Prefect harness, Docker sandboxes, DuckDB, HTTP to the
scripted model. Both modes run: the LLM-mode change is large (9 tasks lost, 1 gained of
12: exact McNemar p = 2 * 11 / 1024), the sandbox-mode one small (1 task lost: noise).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.flows.conftest import containers_of, tiny_tasks, write_tasks
from tests.scripted_model import Reply, ScriptedModel, text_reply, tool_reply

pytestmark = [pytest.mark.usefixtures("prefect_harness", "docker_image"), pytest.mark.slow]

TASKS = [f"t{i}" for i in range(12)]
# night -> mode -> the tasks the model gets wrong
WRONG = {
    1: {"llm": {"t11"}, "sandbox": set()},
    2: {"llm": {f"t{i}" for i in range(9)}, "sandbox": {"t5"}},
}
LLM_DOWN, LLM_UP = sorted(f"t{i}" for i in range(9)), ["t11"]
SANDBOX_DOWN = ["t5"]


def _model(night: dict[str, int]) -> Any:
    def reply(body: dict, index: int) -> Reply:
        task = re.search(r"Task (t\d+):", str(body["messages"][1]["content"]))
        assert task, body["messages"][1]
        mode = "sandbox" if body.get("tools") else "llm"
        answer = "41" if task.group(1) in WRONG[night["n"]][mode] else "42"
        if mode == "llm":
            return text_reply(answer)
        done = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        steps = [
            ("execute_bash", {"command": f"echo {answer} > /testbed/output/answer.txt"}),
            ("submit", {}),
        ]
        name, args = steps[min(done, len(steps) - 1)]
        return tool_reply(name, args)

    return reply


def _bench(ts: Path, wh: Path, server: ScriptedModel, *extra: str) -> Any:
    from sandflow.cli import app

    args = ["bench", "--suite", str(ts), "--base-url", server.url, "--model", "scripted",
            "--warehouse", str(wh), "--concurrency", "4", "--max-steps", "4", "--no-rollouts",
            "--series", "pytest-nightly", *extra]  # fmt: skip
    return CliRunner(env={"COLUMNS": "300"}).invoke(app, args)


def _rows(wh: Path, sql: str) -> list[dict[str, Any]]:
    from warehouse.query import connect

    with connect(wh) as q:
        return q.arrow(sql).to_pylist()


def test_two_nights_find_exactly_the_planted_flips(tmp_path: Path) -> None:
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(12))
    wh = tmp_path / "wh"
    night = {"n": 1}
    with ScriptedModel(default=_model(night), models=("scripted",)) as server:
        first = _bench(ts, wh, server, "--fail-on-regression")
        assert first.exit_code == 0, first.output + repr(first.exception)
        assert "first run of its series" in first.output
        night["n"] = 2
        second = _bench(ts, wh, server, "--fail-on-regression")
    out = second.output
    # --fail-on-regression: the report is still written and printed, then exit code 3
    assert second.exit_code == 3, out + repr(second.exception)
    assert "regression:" in out and "math / llm: 91.7% -> 25.0%" in out.replace("\n", "")
    run1, run2 = re.findall(r"run (\S+): 24 episodes recorded, 0 failed", first.output + out)

    # the Prefect flow run failed, with the message
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["sandflow-nightly"])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
    assert runs[0].state is not None and runs[0].state.is_failed(), runs[0].state
    assert "significant drop since run" in str(runs[0].state.message), runs[0].state.message

    # the warehouse: lineage, and nightly_diff finds exactly the planted flips
    lineage = _rows(wh, "SELECT DISTINCT run_id, series, previous_run_id, image_id FROM run_series ORDER BY run_id")
    by = {r["run_id"]: r for r in lineage}
    assert by[run2]["previous_run_id"] == run1 and by[run1]["previous_run_id"] is None
    assert by[run2]["series"] == "pytest-nightly" and str(by[run2]["image_id"]).startswith("sha256:")
    diff = {(r["domain"], r["mode"]): r for r in _rows(wh, f"SELECT * FROM nightly_diff WHERE run_id = '{run2}'")}
    llm, sandbox = diff[("math", "llm")], diff[("math", "sandbox")]
    assert (sorted(llm["tasks_down"]), llm["tasks_up"]) == (LLM_DOWN, LLM_UP)
    assert (sandbox["tasks_down"], sandbox["tasks_up"]) == (SANDBOX_DOWN, [])
    assert llm["prev_accuracy"] == pytest.approx(11 / 12, abs=1e-4) and llm["accuracy"] == 0.25
    assert llm["test"] == "mcnemar-exact" and llm["p_value"] == pytest.approx(2 * 11 / 1024)
    # Holm over math/llm and math/sandbox (the overall rows repeat them): 2 * p
    assert llm["p_adjusted"] == pytest.approx(2 * 2 * 11 / 1024) and llm["change"] == "down"
    assert not sandbox["significant"] and sandbox["p_value"] == 1.0
    assert diff[("(all)", "llm")]["p_adjusted"] == llm["p_adjusted"]

    # the report: the one significant change, its flips linked to embedded trajectories
    page = (wh / "reports" / run2 / "report.html").read_text()
    md = (wh / "reports" / run2 / "report.md").read_text()
    assert "Changes since the previous run" in page and "Changes since the previous run" in md
    assert page.count("data-change='down'") == 2  # math/llm and its overall row, nothing else
    assert "data-change='up'" not in page
    flips = re.findall(r"<span data-flip='(\w+)' data-task='(t\d+)'>", page)
    assert sorted(t for d, t in flips if d == "down") == sorted(LLM_DOWN + SANDBOX_DOWN)
    assert [t for d, t in flips if d == "up"] == LLM_UP
    anchors = set(re.findall(r"<details id='(ep-[0-9a-f]{16})'", page))
    links = set(re.findall(r'<a href="#(ep-[0-9a-f]{16})">', page))
    assert links and links <= anchors  # every link lands on an embedded trajectory
    assert len(anchors) == 2 * (len(LLM_DOWN) + len(LLM_UP) + len(SANDBOX_DOWN))  # both nights
    assert "echo 41 &gt; /testbed/output/answer.txt" in page  # tonight's wrong sandbox answer, escaped
    plots = set(re.findall(r'data-plot="([^"]+)"', page))
    assert {"Accuracy trend", "Tokens trend", "Usage trend", "Infra failures trend", "Speed trend"} <= plots
    assert "▼ math / llm: 91.7% -> 25.0%" in md and "Flips within the noise: `t5` sandbox down" in md
    assert containers_of(run2) == []
