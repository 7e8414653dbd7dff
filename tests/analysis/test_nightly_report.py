"""The nightly section from series data: what is called out, what is linked, and that
nothing the model (or a task file) wrote can run in the page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from analysis import nightly_report as nr
from warehouse.series import SeriesData

T0 = datetime(2026, 3, 1, 2, tzinfo=UTC)
EVIL_TASK = "t'><img src=x onerror=alert(1)>"
TASKS = [f"t{i:02d}" for i in range(11)] + [EVIL_TASK]


def _outcomes(run: str, wrong: set[str]) -> list[dict[str, Any]]:
    return [
        {
            "run_id": run,
            "episode_id": f"{run}/{t}",
            "task_id": t,
            "domain": "math",
            "mode": "llm",
            "sample_index": 0,
            "score": 0.0 if t in wrong else 1.0,
            "passed": t not in wrong,
            "infra_failure": False,
        }  # fmt: skip
        for t in TASKS
    ]


def _series(wrong_tonight: set[str]) -> SeriesData:
    runs = [
        {
            "run_id": r,
            "run_number": i + 1,
            "started_at": T0 + timedelta(days=i),
            "mode": "llm",
            "image": "img",
            "image_id": "sha256:a",
            "image_changed": False,
            "avg_tokens": 100.0,
            "infra_failures": 0,
            "avg_wall_s": 2.0,
        }  # fmt: skip
        for i, r in enumerate(["a", "b"])
    ]
    return SeriesData(
        run_id="b",
        series={"series": "nightly", "dataset": "tiny", "dataset_hash": "abc", "model": "m"},
        previous_run_id="a",
        runs=runs,
        outcomes=_outcomes("a", {"t10"}) + _outcomes("b", wrong_tonight),
        usage=[{"run_id": "b", "capability": "computation", "turns_with": 3, "turns": 10}],
    )


def test_a_significant_drop_is_called_out_with_links_to_embedded_trajectories() -> None:
    sec = nr.build_section(_series(set(TASKS[:9])))
    assert [(r.domain, r.direction) for r in sec.regressions()] == [
        ("math", "down"),
        ("(all)", "down"),
    ]
    assert "significant drop since run a" in (sec.regression_message() or "")
    want = sec.episodes_to_link()
    assert sorted(want) == ["a", "b"] and len(want["b"]) == 10  # 9 down + t10 up
    evil = "<script>alert('x')</script>"
    sec.trajectories = {
        (run, ep): {
            "task_id": ep.split("/", 1)[1],
            "mode": "llm",
            "sample_index": 0,
            "score": 0.0,
            "termination": "submitted",
            "num_turns": 1,
            "answer": evil,
            "turns": [
                {
                    "turn_index": 0,
                    "assistant_content": evil,
                    "tool_calls": [{"name": "execute_bash", "arguments": evil}],
                    "observations": [{"content": evil, "exit_code": 0}],
                }
            ],
        }  # fmt: skip
        for run, eps in want.items()
        for ep in eps
    }
    page = nr.to_html(sec)
    assert "<script" not in page and "<img src=x" not in page and "onerror=alert(1)>" not in page
    assert "&lt;script&gt;" in page
    md = nr.to_markdown(sec)
    assert md.count("(report.html#ep-") == 2 * 10  # previous + tonight for each linked flip
    links = {a for a in page.split('href="#')[1:]}
    assert len(links) == 20 and page.count("<details id='ep-") == 20
    assert "Accuracy trend" in page  # two runs: trend plots
    sec.viewer_url = "http://127.0.0.1:8765/"  # `sandflow view`: a side-by-side page per flip
    page, md = nr.to_html(sec), nr.to_markdown(sec)
    assert (
        page.count(
            'class="viewer" href="http://127.0.0.1:8765/compare?a=a%2Fa%2Ft00&amp;b=b%2Fb%2Ft00"'
        )
        == 1
    )
    assert md.count("[side by side](http://127.0.0.1:8765/compare?a=") == 10


def test_noise_is_not_called_out() -> None:
    sec = nr.build_section(_series({"t03"}))  # one task lost, t10 regained: noise
    assert sec.regressions() == [] and sec.regression_message() is None
    md = nr.to_markdown(sec)
    assert "No significant change" in md and "Flips within the noise: `t03` llm down" in md
    assert "data-change='none'" in nr.to_html(sec)


def test_another_prompt_set_since_the_previous_run_is_said_beside_the_comparison() -> None:
    data = _series({"t03"})
    assert "prompt set" not in nr.to_markdown(nr.build_section(data))
    data.runs[1]["prompts_changed"] = True  # run_series' flag (warehouse/series.py)
    sec = nr.build_section(data)
    assert "**The prompt set (and its tools) changed since then.**" in nr.to_markdown(sec)
    assert "<b>The prompt set (and its tools) changed since then.</b>" in nr.to_html(sec)


def test_first_run_of_a_series_has_nothing_to_compare() -> None:
    data = _series(set())
    data.previous_run_id = None
    data.runs = data.runs[1:]
    sec = nr.build_section(data)
    assert sec.comparison == [] and "First run of its series" in nr.to_markdown(sec)
    assert nr.trend_plots(sec) == []  # a single run: no trend


def test_embedded_trajectories_stay_within_the_page_budget(monkeypatch: Any) -> None:
    sec = nr.build_section(_series(set(TASKS[:9])))
    big = "x" * 5000
    sec.trajectories = {
        (run, ep): {
            "task_id": ep,
            "turns": [{"turn_index": i, "assistant_content": big} for i in range(30)],
        }
        for run, eps in sec.episodes_to_link().items()
        for ep in eps
    }
    monkeypatch.setattr(nr, "MAX_EMBEDDED_CHARS", 400_000)
    page = nr.to_html(sec)
    assert len(page) < 600_000 and page.count("<details id='ep-") == 20  # every link still lands
    assert "size bound for trajectories is reached" in page


def test_pass_at_k_table_only_with_several_samples() -> None:
    from analysis.comparisons import Outcome

    def o(task: str, sample: int, score: float) -> Outcome:
        return Outcome("r", f"{task}{sample}", task, "math", "llm", sample, score, score == 1.0)

    # a: 1 of 2 passed, b: 0 of 2 -> pass@1 = 25%, pass@2 = (1 + 0) / 2 = 50%
    rows = nr.pass_at_k_table([o("a", 0, 1.0), o("a", 1, 0.0), o("b", 0, 0.0), o("b", 1, 0.0)])
    got = {(r["domain"], r["k"]): r["pass_at_k"] for r in rows}
    assert got == {("math", 1): 25.0, ("math", 2): 50.0, ("(all)", 1): 25.0, ("(all)", 2): 50.0}
    assert nr.pass_at_k_table([o("a", 0, 1.0), o("b", 0, 0.0)]) == []
