"""Outcomes -> comparison rows: flips, infra kept apart, Holm's family, modes, flaky tasks."""

from __future__ import annotations

import pytest

from analysis import comparisons as cmp
from analysis.comparisons import ALL, Outcome


def _o(
    run: str,
    task: str,
    score: float | None,
    *,
    mode: str = "llm",
    domain: str = "math",
    sample: int = 0,
    infra: bool = False,
) -> Outcome:
    return Outcome(
        run_id=run, episode_id=f"{run}:{task}:{mode}:{sample}", task_id=task, domain=domain, mode=mode,
        sample_index=sample, score=None if infra else score, passed=None if infra else score == 1.0,
        infra_failure=infra,
    )  # fmt: skip


def _night(run: str, solved: set[str], tasks: list[str], **kw: object) -> list[Outcome]:
    return [_o(run, t, 1.0 if t in solved else 0.0, **kw) for t in tasks]  # type: ignore[arg-type]


TASKS = [f"t{i:02d}" for i in range(12)]


def test_a_planted_drop_is_found_with_exactly_its_flips() -> None:
    before = _night("a", set(TASKS[:11]), TASKS)  # t11 unsolved
    after = _night("b", set(TASKS[9:]), TASKS)  # t00..t08 lost, t11 gained
    rows = cmp.compare_runs(before, after)
    assert [(r.domain, r.mode) for r in rows] == [("math", "llm"), (ALL, "llm")]
    math, overall = rows
    assert [f.task_id for f in math.flips if f.direction == "down"] == TASKS[:9]
    assert [f.task_id for f in math.flips if f.direction == "up"] == ["t11"]
    assert math.flips[0].episodes_before == ("a:t00:llm:0",) and math.flips[0].episodes_after == (
        "b:t00:llm:0",
    )
    assert math.paired.test == "mcnemar-exact" and math.paired.p_value == pytest.approx(
        2 * 11 / 1024
    )
    # one domain: the overall row repeats its test and is not counted twice by Holm
    assert math.p_adjusted == pytest.approx(math.paired.p_value) == overall.p_adjusted
    assert math.is_regression and overall.is_regression and cmp.regressions(rows) == rows
    assert "math / llm: 91.7% -> 25.0% (-66.7 pts" in cmp.describe_change(math)


def test_two_domains_are_one_holm_family() -> None:
    before = _night("a", set(TASKS), TASKS) + _night("a", {"c0"}, ["c0", "c1"], domain="chem")
    after = _night("b", set(), TASKS) + _night("b", {"c1"}, ["c0", "c1"], domain="chem")
    rows = {r.domain: r for r in cmp.compare_runs(before, after)}
    p = {d: r.paired.p_value for d, r in rows.items()}
    from statsmodels.stats.multitest import multipletests

    expect = multipletests([p["chem"], p["math"], p[ALL]], method="holm")[1]
    assert [
        rows["chem"].p_adjusted,
        rows["math"].p_adjusted,
        rows[ALL].p_adjusted,
    ] == pytest.approx(list(expect))
    assert rows["math"].significant and not rows["chem"].significant


def test_infra_failures_are_unmatched_never_flips() -> None:
    before = _night("a", set(TASKS), TASKS)
    after = [
        _o("b", t, None, infra=True) if t in ("t00", "t01") else _o("b", t, 1.0) for t in TASKS
    ]
    (math, _overall) = cmp.compare_runs(before, after)
    assert math.flips == () and math.unmatched == 2 and (math.infra_a, math.infra_b) == (0, 2)
    assert math.paired.n_tasks == 10 and math.paired.diff.estimate == 0 and not math.significant


def test_several_samples_use_the_sign_test_on_task_means() -> None:
    before = [_o("a", t, 1.0, sample=s) for t in TASKS[:6] for s in range(2)]
    after = [_o("b", t, 1.0 if s == 0 else 0.0, sample=s) for t in TASKS[:6] for s in range(2)]
    math = cmp.compare_runs(before, after)[0]
    assert math.paired.test == "sign-test" and math.paired.worsened == 6
    assert math.flips == ()  # 1.0 -> 0.5 is still "solved" (mean >= 0.5)
    assert math.paired.diff.estimate == pytest.approx(-0.5)


def test_sandbox_against_llm_mode_is_the_same_comparison() -> None:
    outs = _night("r", set(TASKS[:3]), TASKS, mode="llm") + _night(
        "r", set(TASKS[:10]), TASKS, mode="sandbox"
    )
    rows = cmp.compare_modes(outs)
    assert [(r.domain, r.mode) for r in rows] == [
        ("math", "sandbox vs llm"),
        (ALL, "sandbox vs llm"),
    ]
    assert rows[0].paired.diff.estimate == pytest.approx(7 / 12) and rows[0].direction == "up"
    assert cmp.compare_modes(_night("r", set(), TASKS)) == []  # one mode: nothing to compare
    row = rows[0].row()
    assert (row["before"], row["after"], row["diff"], row["up"], row["down"]) == (
        25.0,
        83.3,
        58.3,
        7,
        0,
    )


def test_accuracy_intervals_per_domain_and_overall() -> None:
    outs = _night("r", set(TASKS[:6]), TASKS) + _night("r", {"c0"}, ["c0", "c1"], domain="chem")
    outs.append(_o("r", "c2", None, domain="chem", infra=True))
    iv = cmp.accuracy_intervals(outs)
    assert iv[("math", "llm")].estimate == 0.5 and iv[("chem", "llm")].n_tasks == 2
    assert iv[(ALL, "llm")].estimate == pytest.approx(7 / 14) and iv[(ALL, "llm")].n_samples == 14
    rows = cmp.with_intervals([{"domain": "math", "mode": "llm", "accuracy": 50.0}], iv)
    assert rows[0]["tasks"] == 12 and rows[0]["ci_low"] < 50.0 < rows[0]["ci_high"]


def test_flaky_tasks_ignore_image_changes() -> None:
    def night(run: str, image: str, solved: set[str]) -> cmp.Night:
        return cmp.Night(run, image, cmp.task_results(_night(run, solved, ["x", "y", "z"])))

    nights = [
        night("1", "i1", {"x", "y"}),
        night("2", "i1", {"y"}),  # x flips
        night("3", "i2", {"x", "z"}),  # new image: no flip counted
        night("4", "i2", {"x"}),  # z flips
        night("5", "i2", {"x", "z"}),  # z flips back
    ]
    got = {
        f.task_id: (f.flips, f.comparable, f.runs, f.solved_runs) for f in cmp.flaky_tasks(nights)
    }
    assert got == {"z": (2, 3, 5, 2), "x": (1, 3, 5, 4)}
