"""The lineage and statistics views, on a real warehouse, against analysis/ in Python.

The warehouse holds five nights of one series (one interrupted, an image change, a
planted drop, infra failures, two samples per task on later nights) plus two runs of
other series. The Python side computes from the plan itself, never from the views.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from analysis import comparisons as cmp
from analysis import statistics as st
from tests.analysis.conftest import INFRA, NightPlan, write_night

MATH = [f"t{i}" for i in range(8)]
CHEM = [f"c{i}" for i in range(6)]
DOMAINS = {**{t: "math" for t in MATH}, **{t: "chem" for t in CHEM}}
MODES = ("llm", "sandbox")
VIEWS = ("episode_outcomes", "run_series", "nightly_diff", "flaky_tasks", "pass_at_k")


def _night(
    run_id: str, day: int, rng: np.random.Generator, samples: int = 1, **kw: Any
) -> NightPlan:
    values = [0.0, 1.0] if samples == 1 else [0.0, 0.5, 1.0]
    outcomes: dict[tuple[str, str, int], float | str] = {
        (m, t, s): float(rng.choice(values)) for m in MODES for t in DOMAINS for s in range(samples)
    }
    return NightPlan(run_id=run_id, day=day, outcomes=outcomes, domains=DOMAINS, **kw)


@pytest.fixture(scope="module")
def nights(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[NightPlan], list[NightPlan]]:
    rng = np.random.default_rng(16)
    n1 = _night("n1", 0, rng)
    n2 = _night("n2", 1, rng)
    n2.outcomes[("llm", "t3", 0)] = INFRA
    partial = _night("n-int", 2, rng, status="interrupted")
    partial.outcomes = {k: v for k, v in partial.outcomes.items() if k[1] in MATH[:4]}
    n3 = _night("n3", 3, rng, samples=2, image_id="sha256:bbb")
    n3.outcomes[("sandbox", "c2", 1)] = INFRA
    n4 = _night("n4", 4, rng, samples=2, image_id="sha256:bbb", config={"prompts": "small"})
    for t in MATH:  # the planted drop: math in LLM mode solves nothing tonight
        for s in range(2):
            n4.outcomes[("llm", t, s)] = 0.0
            n3.outcomes[("llm", t, s)] = 1.0
    n4.outcomes[("sandbox", "t0", 0)] = n4.outcomes[("sandbox", "t0", 1)] = INFRA  # unmatched
    series = [n1, n2, partial, n3, n4]
    others = [
        _night("adhoc", 1, rng, series=None),  # ad hoc: its own series
        _night("other-model", 2, rng, model="m2"),
    ]
    root = tmp_path_factory.mktemp("wh")
    for n in series + others:
        write_night(root, n)
    return root, series, others


def _rows(root: Path, sql: str) -> list[dict[str, Any]]:
    from warehouse.query import connect

    with connect(root) as q:
        return q.arrow(sql).to_pylist()


def _same(sql: float | None, py: float | None, tol: float) -> bool:
    return (sql is None and py is None) or (
        sql is not None and py is not None and abs(sql - py) <= tol
    )


def test_views_exist_in_an_empty_warehouse(tmp_path: Path) -> None:
    from sandflow.cli import app

    (tmp_path / "wh").mkdir()
    for view in VIEWS:
        res = CliRunner().invoke(
            app, ["sql", "--warehouse", str(tmp_path / "wh"), f"SELECT * FROM {view} LIMIT 0"]
        )
        assert res.exit_code == 0, (view, res.output)
    res = CliRunner().invoke(app, ["sql", "--warehouse", str(tmp_path / "wh")])
    assert all(v in res.output for v in VIEWS), res.output  # listed with the other views


def test_run_series_lineage(nights: tuple[Path, list[NightPlan], list[NightPlan]]) -> None:
    root, series, others = nights
    rows = _rows(
        root,
        "SELECT DISTINCT run_id, series, series_key, run_number, previous_run_id, image_changed,"
        " prompts_changed FROM run_series",
    )
    by = {r["run_id"]: r for r in rows}
    assert len({by[n.run_id]["series_key"] for n in series}) == 1
    assert len({r["series_key"] for r in rows}) == 3  # + ad hoc, + the other model
    assert by["adhoc"]["series"] == "(ad hoc)" and by["adhoc"]["previous_run_id"] is None
    assert [by[n.run_id]["run_number"] for n in series] == [1, 2, 3, 4, 5]
    # the interrupted night is never anyone's previous run
    assert {n.run_id: by[n.run_id]["previous_run_id"] for n in series} == {
        "n1": None, "n2": "n1", "n-int": "n2", "n3": "n2", "n4": "n3",
    }  # fmt: skip
    assert by["n3"]["image_changed"] and not by["n4"]["image_changed"]
    # the prompt set picks the tools: another one is another experiment, and the view says so
    assert by["n4"]["prompts_changed"] and not by["n3"]["prompts_changed"]
    assert not any(by[n]["prompts_changed"] for n in ("n1", "n2", "adhoc"))


def test_run_series_accuracy_and_se_match_python(
    nights: tuple[Path, list[NightPlan], list[NightPlan]],
) -> None:
    root, series, _ = nights
    rows = _rows(root, "SELECT * FROM run_series WHERE run_id IN ('n2', 'n3')")
    for r in rows:
        night = next(n for n in series if n.run_id == r["run_id"])
        outs = [o for o in night.outcome_list() if o.mode == r["mode"]]
        iv = st.mean_interval(
            [o.score if o.scored else np.nan for o in outs], [o.task_id for o in outs]
        )
        assert r["accuracy"] == pytest.approx(iv.estimate, abs=1e-4)
        assert r["accuracy_se"] == pytest.approx(iv.se, abs=1e-4)
        assert r["infra_failures"] == sum(o.infra_failure for o in outs)
        assert r["tasks"] == iv.n_tasks and r["scored"] == iv.n_samples


def test_nightly_diff_matches_the_python_comparison(
    nights: tuple[Path, list[NightPlan], list[NightPlan]],
) -> None:
    root, series, _ = nights
    prev_of = {"n2": "n1", "n-int": "n2", "n3": "n2", "n4": "n3"}
    plan = {n.run_id: n for n in series}
    rows = _rows(root, "SELECT * FROM nightly_diff")
    assert {r["run_id"] for r in rows} == set(prev_of)
    for run, prev in prev_of.items():
        py = cmp.compare_runs(plan[prev].outcome_list(), plan[run].outcome_list())
        sql = {(r["domain"], r["mode"]): r for r in rows if r["run_id"] == run}
        assert set(sql) == {(c.domain, c.mode) for c in py}, run
        for c in py:
            r = sql[(c.domain, c.mode)]
            where = f"{run} {c.domain}/{c.mode}"
            assert r["previous_run_id"] == prev
            assert r["tasks"] == c.paired.n_tasks, where
            assert r["unmatched_tasks"] == c.unmatched, where
            assert (r["prev_infra_failures"], r["infra_failures"]) == (c.infra_a, c.infra_b), where
            assert (r["improved"], r["worsened"]) == (c.paired.improved, c.paired.worsened), where
            assert r["tasks_down"] == [f.task_id for f in c.flips if f.direction == "down"], where
            assert r["tasks_up"] == [f.task_id for f in c.flips if f.direction == "up"], where
            assert r["test"] == c.paired.test, where
            assert _same(r["p_value"], c.paired.p_value, 1e-12), where
            assert _same(r["p_adjusted"], c.p_adjusted, 1e-12), where
            assert r["significant"] == c.significant, where
            assert _same(r["diff"], c.paired.diff.estimate, 1e-4), where
            assert _same(r["diff_se"], c.paired.diff.se, 1e-4), where
    # the planted drop is found, and only there
    drops = [(r["run_id"], r["domain"], r["mode"]) for r in rows if r["change"] == "down"]
    assert ("n4", "math", "llm") in drops and all(run == "n4" for run, _, _ in drops)
    math_llm = next(
        r for r in rows if (r["run_id"], r["domain"], r["mode"]) == ("n4", "math", "llm")
    )
    assert (
        math_llm["tasks_down"] == MATH
        and math_llm["prev_accuracy"] == 1.0
        and math_llm["accuracy"] == 0.0
    )
    assert math_llm["test"] == "sign-test"  # two samples per task
    assert math_llm["p_value"] == pytest.approx(2 / 2**8)  # 8 of 8 tasks worse


def test_pass_at_k_matches_python(nights: tuple[Path, list[NightPlan], list[NightPlan]]) -> None:
    root, series, _ = nights
    n3 = next(n for n in series if n.run_id == "n3")
    rows = _rows(root, "SELECT * FROM pass_at_k WHERE run_id = 'n3'")
    outs = [o for o in n3.outcome_list() if o.scored]
    for domain in ("math", "chem", cmp.ALL):
        for mode in MODES:
            sel = [o for o in outs if o.mode == mode and (domain == cmp.ALL or o.domain == domain)]
            curve = st.pass_at_k_curve(
                [o.task_id for o in sel], [o.passed for o in sel], [o.score for o in sel]
            )
            got = {r["k"]: r for r in rows if r["domain"] == domain and r["mode"] == mode}
            assert sorted(got) == [p.k for p in curve] == [1, 2]
            for p in curve:
                assert got[p.k]["tasks"] == p.tasks
                assert got[p.k]["pass_at_k"] == pytest.approx(p.pass_at_k.estimate, abs=1e-6)
                assert got[p.k]["mean_at_k"] == pytest.approx(p.mean_at_k.estimate, abs=1e-6)
    # c2 in sandbox mode lost a sample to an infra failure: only k = 1 counts it
    chem_sb = {r["k"]: r["tasks"] for r in rows if r["domain"] == "chem" and r["mode"] == "sandbox"}
    assert chem_sb == {1: 6, 2: 5}


def test_flaky_tasks_match_python(nights: tuple[Path, list[NightPlan], list[NightPlan]]) -> None:
    root, series, _ = nights
    py_nights = [
        cmp.Night(n.run_id, n.image_id or n.image, cmp.task_results(n.outcome_list()))
        for n in series
    ]
    expected = {(f.mode, f.task_id): f for f in cmp.flaky_tasks(py_nights)}
    rows = _rows(root, "SELECT * FROM flaky_tasks WHERE series = 'nightly' AND model = 'm1'")
    got = {(r["mode"], r["task_id"]): r for r in rows}
    assert set(got) == set(expected) and expected
    for key, f in expected.items():
        r = got[key]
        assert (r["runs"], r["solved_runs"], r["comparable"], r["flips"]) == (
            f.runs,
            f.solved_runs,
            f.comparable,
            f.flips,
        ), key
        assert r["last_run_id"] == f.last_run_id
    # n2 -> n-int -> n3 crosses the image change: that pair never counts
    assert all(r["comparable"] <= r["runs"] - 1 for r in rows)
    assert any(r["comparable"] < r["runs"] - 1 for r in rows)


def test_a_run_file_from_before_lineage_still_reads(tmp_path: Path) -> None:
    """An old runs file (no series / image_id columns) reads; the run is ad hoc."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from warehouse.layout import Layout
    from warehouse.schema import RUNS, file_metadata

    night = NightPlan(run_id="old", day=0, outcomes={("llm", "t0", 0): 1.0}, domains=DOMAINS)
    write_night(tmp_path, night)
    path = Layout(tmp_path).run_file("old")
    old_names = [n for n in RUNS.names if n not in ("series", "image_id")]
    table = pq.read_table(path).select(old_names)
    pq.write_table(table.replace_schema_metadata(file_metadata("runs", old_names)), path)
    assert "series" not in pq.read_schema(path).names
    rows = _rows(tmp_path, "SELECT run_id, series, image_id, accuracy FROM run_series")
    assert rows == [{"run_id": "old", "series": "(ad hoc)", "image_id": None, "accuracy": 1.0}]
    _ = pa  # the table above is pyarrow's


def test_single_domain_overall_row_shares_its_domain_test(tmp_path: Path) -> None:
    """12 tasks, 9 lost and 1 gained: McNemar p = 2 * 11 / 1024, the same after Holm
    (the overall row repeats the math row's test, so the family has one member)."""
    tasks = [f"t{i:02d}" for i in range(12)]
    doms = {t: "math" for t in tasks}
    before = NightPlan("a", 0, {("llm", t, 0): 0.0 if t == "t11" else 1.0 for t in tasks}, doms)
    after = NightPlan(
        "b", 1, {("llm", t, 0): 1.0 if t in ("t09", "t10", "t11") else 0.0 for t in tasks}, doms
    )
    for n in (before, after):
        write_night(tmp_path, n)
    rows = {r["domain"]: r for r in _rows(tmp_path, "SELECT * FROM nightly_diff")}
    assert set(rows) == {"math", cmp.ALL}
    for r in rows.values():
        assert r["test"] == "mcnemar-exact" and r["p_value"] == pytest.approx(2 * 11 / 1024)
        assert r["p_adjusted"] == pytest.approx(2 * 11 / 1024) and r["change"] == "down"
        assert r["tasks_down"] == tasks[:9] and r["tasks_up"] == ["t11"]


def test_compare_any_two_runs_from_the_cli(
    nights: tuple[Path, list[NightPlan], list[NightPlan]], tmp_path: Path
) -> None:
    import json

    from sandflow.cli import app

    root, series, _ = nights
    plan = {n.run_id: n for n in series}
    res = CliRunner().invoke(
        app, ["compare", "n3", "n4", "-w", str(root), "--json", "--fail-on-regression"]
    )
    assert res.exit_code == 3, res.output  # the planted drop
    rows = {(r["domain"], r["mode"]): r for r in json.loads(res.output)["rows"]}
    py = {
        (c.domain, c.mode): c.row()
        for c in cmp.compare_runs(plan["n3"].outcome_list(), plan["n4"].outcome_list())
    }
    assert rows == {k: json.loads(json.dumps(v)) for k, v in py.items()}
    assert rows[("math", "llm")]["significant"] and rows[("math", "llm")]["down"] == 8
    # one run: sandbox vs LLM mode; its table prints
    res = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["compare", "n1", "-w", str(root)])
    assert res.exit_code == 0 and "sandbox vs LLM mode of n1" in res.output, res.output
    # another task set: refused, naming both hashes
    other = NightPlan("other-set", 9, {("llm", "t0", 0): 1.0}, DOMAINS, dataset_hash="hash-b")
    write_night(tmp_path, other)
    write_night(tmp_path, NightPlan("base", 8, {("llm", "t0", 0): 1.0}, DOMAINS))
    res = CliRunner().invoke(app, ["compare", "base", "other-set", "-w", str(tmp_path)])
    assert res.exit_code == 1 and "different task sets" in res.output and "hash-b" in res.output, (
        res.output
    )
    res = CliRunner().invoke(app, ["compare", "base", "nope", "-w", str(tmp_path)])
    assert res.exit_code == 1 and "'nope' has no episodes" in res.output, res.output


def test_compare_refuses_runs_of_unlike_tasks(tmp_path: Path) -> None:
    """Issue #22: runs of SandboxEnv, `rl serve` and `sandflow run --warehouse` named no
    task set and were paired with anything (other tasks under the same ids gave a
    "significant" drop). Runs now keep the tasks they ran; compare matches them by content."""
    from datasets_prep.task import Task
    from sandflow.cli import app
    from warehouse import Warehouse

    outcomes: dict[tuple[str, str, int], float | str] = {("sandbox", "t0", 0): 1.0, ("sandbox", "t1", 0): 0.0}
    domains = {"t0": "math", "t1": "math"}

    def task(i: int, question: str) -> Task:
        return Task(id=f"t{i}", domain="math", problem_statement=question, ground_truth="1", qa_type="exact")

    wh = Warehouse(tmp_path)
    for rid, question in (("env-a", "q0"), ("env-b", "q0"), ("env-c", "another question"), ("env-d", "q0")):
        write_night(tmp_path, NightPlan(rid, 1, outcomes, domains, series=None, dataset_hash=""))
        wh.keep_tasks(rid, [task(0, question), task(1, "q1")])
    wh.keep_tasks("env-d", [task(0, "a second task t0")])  # a trainer sent two tasks as t0
    write_night(tmp_path, NightPlan("old", 1, outcomes, domains, series=None, dataset_hash=""))

    def compare(a: str, b: str) -> tuple[int, str]:
        res = CliRunner().invoke(app, ["compare", a, b, "-w", str(tmp_path), "--json"])
        return res.exit_code, " ".join(res.output.split())  # (rich may wrap the sentence)

    code, out = compare("env-a", "env-b")  # the same tasks: paired
    assert code == 0 and json.loads(out)["rows"], out
    code, out = compare("env-a", "env-c")
    assert code == 1 and "ran different tasks under the same id (1 of 2 shared ids: 't0')" in out
    code, out = compare("env-a", "env-d")
    assert code == 1 and "run 'env-d' ran different tasks under the same id ('t0')" in out
    write_night(tmp_path, NightPlan("env-e", 1, {("sandbox", "t9", 0): 1.0}, {"t9": "math"}, series=None, dataset_hash=""))
    wh.keep_tasks("env-e", [task(9, "q9")])
    code, out = compare("env-a", "env-e")
    assert code == 1 and "runs 'env-a' and 'env-e' ran no task in common" in out
    code, out = compare("env-a", "old")
    assert code == 1 and "run 'old' records neither the tasks it ran nor a task-set hash" in out


def test_pass_at_k_view_says_why_a_k_has_no_estimate(tmp_path: Path) -> None:
    """Issue #22: the view returned no row for a k above a group's sample count. Math ran
    3 samples per task, chem 1: chem's k = 2, 3 rows say there is no task with that many,
    and the (all) rows name the tasks they leave out."""
    outcomes: dict[tuple[str, str, int], float | str] = {
        **{("llm", t, s): float(s == 0) for t in ("m0", "m1") for s in range(3)},
        ("llm", "c0", 0): 1.0,
    }
    write_night(tmp_path, NightPlan("mixed", 1, outcomes, {"m0": "math", "m1": "math", "c0": "chem"}))
    rows = {(r["domain"], r["k"]): r for r in _rows(tmp_path, "SELECT * FROM pass_at_k")}
    assert sorted(k for d, k in rows if d == "chem") == [1, 2, 3]
    chem2 = rows[("chem", 2)]
    assert chem2["tasks"] == 0 and chem2["pass_at_k"] is None
    assert chem2["note"] == "no task has 2 samples here (at most 1): pass@2 needs at least 2 samples per task"
    all3 = rows[("(all)", 3)]
    assert all3["tasks"] == 2 and all3["tasks_left_out"] == 1 and all3["pass_at_k"] == 1.0
    assert "1 of 3 tasks have fewer than 3 samples (as few as 1) and are left out" in all3["note"]
    assert rows[("math", 2)]["note"] is None and rows[("math", 2)]["pass_at_k"] == pytest.approx(2 / 3, abs=1e-6)
