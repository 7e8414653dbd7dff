"""The report: self-contained HTML opened in headless Debian Chromium (plots and tables
render), Markdown with the same tables, and the paper's numbers computed right."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from analysis import metrics as analysis
from analysis.report import ReportData, to_markdown, write_report
from tasks.records import EpisodeRecord, ToolCall, TurnRecord
from warehouse.rundata import RunData

NOW = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "pytest-report"


def _bash(cmd: str) -> ToolCall:
    return ToolCall(id="c", name="execute_bash", arguments=json.dumps({"command": cmd}))


def _run() -> RunData:
    eps, turns, scores = [], [], {}
    plan = [
        # domain, task, mode, tokens, score, commands per turn
        ("math", "m1", "sandbox", 300, 1.0, ["python3 a.py", "cat out.txt", "echo 1 > /testbed/output/answer.txt"]),
        ("math", "m1", "llm", 600, 0.0, []),
        ("math", "m2", "sandbox", 100, 0.0, ["python3 b.py"]),
        ("math", "m2", "llm", 200, 1.0, []),
        ("chem", "c1", "sandbox", 800, 1.0, ["pip install rdkit", "python3 mol.py", "ls"]),
        ("chem", "c1", "llm", 400, 0.0, []),
    ]
    for i, (domain, task, mode, tokens, score, cmds) in enumerate(plan):
        eid = f"e{i}"
        eps.append(
            EpisodeRecord(
                run_id=RUN, episode_id=eid, task_id=task, domain=domain, mode=mode,  # type: ignore[arg-type]
                model="m", started_at=NOW, termination="submitted" if cmds or mode == "llm" else "max_steps",
                num_turns=max(1, len(cmds)), prompt_tokens=tokens - 50, completion_tokens=50,
            )
        )
        scores[eid] = score
        for j, c in enumerate(cmds or [None]):
            turns.append(
                TurnRecord(run_id=RUN, episode_id=eid, turn_index=j, started_at=NOW,
                           tool_calls=[_bash(c)] if c else [])
            )
    eps.append(
        EpisodeRecord(run_id=RUN, episode_id="bad", task_id="c1", domain="chem", mode="sandbox",
                      sample_index=1, model="m", started_at=NOW, termination="sandbox_error")
    )
    return RunData.from_records(RUN, eps, turns, scores)


def test_paper_numbers() -> None:
    data = _run()
    acc = {(r["domain"], r["mode"]): r for r in analysis.accuracy(data)}
    assert acc[("math", "sandbox")]["accuracy"] == 50.0 and acc[("math", "llm")]["accuracy"] == 50.0
    assert acc[("chem", "sandbox")]["accuracy"] == 100.0 and acc[("chem", "sandbox")]["infra_failures"] == 1
    assert acc[(analysis.ALL, "sandbox")]["episodes"] == 3
    usage = {(r["domain"], r["mode"]): r for r in analysis.usage_rates(analysis.turn_labels(data))}
    # math sandbox turns: python, cat, echo>file, python -> computation 2/4, files 2/4
    assert usage[("math", "sandbox")]["computation"] == 50.0
    assert usage[("math", "sandbox")]["file_management"] == 50.0
    # chem: pip, python, ls -> external 1/3
    assert usage[("chem", "sandbox")]["external_resource"] == pytest.approx(33.3)
    assert ("math", "llm") not in usage  # LLM mode has no sandbox turns
    ratio = analysis.sandbox_llm_ratio(analysis.episode_tokens(data))
    assert ratio["math"] == pytest.approx((300 + 100) / (600 + 200), rel=1e-3)
    assert ratio["chem"] == pytest.approx(2.0)
    assert ratio[analysis.ALL] == pytest.approx(1200 / 1200)


def test_markdown_has_every_table() -> None:
    md = to_markdown(ReportData.from_run(_run(), {"model": "m"}))
    for title in ("Accuracy by domain x mode", "Tokens per episode", "Capability usage", "Turns per episode", "Termination reasons"):
        assert f"## {title}" in md
    assert "| chem | sandbox |" in md and "sandbox_error" in md


def test_every_accuracy_has_its_interval_and_modes_are_paired_by_task() -> None:
    rd = ReportData.from_run(_run())
    acc = {(r["domain"], r["mode"]): r for r in rd.accuracy}
    m = acc[("math", "sandbox")]  # m1 right, m2 wrong: 50% over 2 tasks
    assert m["tasks"] == 2 and m["se"] == 50.0 and m["ci_low"] <= 50.0 <= m["ci_high"]
    assert acc[("chem", "sandbox")]["ci_low"] is not None  # 1/1: a Wilson interval, not certainty
    modes = {r["domain"]: r for r in rd.modes}
    # math: m1 0 -> 1 and m2 1 -> 0 in sandbox vs llm; chem c1 0 -> 1
    assert (modes["math"]["up"], modes["math"]["down"], modes["math"]["diff"]) == (1, 1, 0.0)
    assert modes["chem"]["diff"] == 100.0 and modes["(all)"]["tasks"] == 3
    assert modes["math"]["test"] == "mcnemar-exact" and modes["math"]["p"] == 1.0
    assert rd.pass_at_k == []  # one sample per task: no pass@k table
    assert "## Sandbox vs LLM mode, paired by task" in to_markdown(rd)


@pytest.mark.slow
def test_html_renders_in_headless_chromium(tmp_path: Path, short_tmp: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed: `apt-get install -y chromium` (scripts/setup.sh --test)")
    html_path, _ = write_report(ReportData.from_run(_run(), {"model": "m"}), tmp_path / "report")
    text = html_path.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text  # self-contained
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
    ]  # fmt: skip
    # Chromium binds its singleton socket under TMPDIR: a short one (tests/conftest.py)
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    dom = subprocess.run(
        [chromium, *flags, "--dump-dom", html_path.as_uri()], capture_output=True, text=True, timeout=120, env=env
    ).stdout
    imgs = re.findall(r'<img [^>]*data-plot="([^"]+)"[^>]*src="data:image/png;base64,', dom)
    assert set(imgs) == {"Accuracy", "Tokens", "Capability usage", "Turns", "Terminations"}
    tables = re.findall(r'<table data-table="(\w+)">', dom)
    assert tables == ["accuracy", "modes", "tokens", "usage", "turns", "terminations"]
    assert dom.count("<tr>") > 15
    shot = tmp_path / "shot.png"
    subprocess.run(
        [chromium, *flags, "--window-size=1280,2400", f"--screenshot={shot}", html_path.as_uri()],
        capture_output=True, timeout=120, env=env,
    )
    assert shot.exists() and shot.stat().st_size > 10_000
    import matplotlib.image as mpimg
    import numpy as np

    px = (mpimg.imread(shot)[..., :3] * 255).round().astype(int)
    # matplotlib's first bar colour (#1f77b4) exists on the page only if the plots drew
    blue = np.all(np.abs(px - np.array([0x1F, 0x77, 0xB4])) <= 6, axis=-1).sum()
    assert blue > 2000, f"only {blue} plot-blue pixels: the plots did not render"
