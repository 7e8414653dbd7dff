"""Rows the trainer scores right (issue #36): every built-in suite's RL rows, exported as
`sandflow flows rollouts` writes them, read back from the Parquet file and scored by
LLM-in-Sandbox-RL's own reward (tests/datagen/lis_rl.py: the peer package in its venv).

A correct answer (the form the task's prompt asks for, which sandflow's verifier scores 1)
must get full marks and a wrong one less; on main 78 of 170 rows gave a correct answer 0
(quantities travelled as {"value": ..., "unit": ...} JSON text, lists as JSON arrays,
multiple-choice letters "A,C" against chem's string comparison). Instruction-following
rows reach the peer's IFBench check, which needs an IFBench checkout no package ships:
there the test checks the route got our spec (it says "IFBench not found", not a JSON
error). Also: a default data build's rows route (its domain was `general`, which the peer
asserts against), and a ground truth no route can score is refused and counted.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest

from datasets_prep.rows import lis_rl_route, task_from_row, task_rows
from datasets_prep.suites import SUITES, build_suite
from datasets_prep.task import Task
from datasets_prep.verifiers import score
from tests.datagen.lis_rl import lis_rl_python, lis_rl_scores


@pytest.fixture(scope="module")
def lis_rl() -> Path:
    return lis_rl_python()


def _number(x: float) -> str:
    return repr(x) if isinstance(x, float) else str(x)


def right_answer(t: Task) -> str:
    """What a policy that solved `t` writes to answer.txt, in the form the prompt asks."""
    gt = t.ground_truth
    if isinstance(gt, list):
        return str(gt[0])  # "Answer with its symbol."
    if isinstance(gt, dict):
        number = _number(gt["value"])
        return f"{number} {gt['unit']}" if "with its unit" in t.problem_statement else number  # "Answer in kJ."
    if t.qa_type == "math":
        return "\\boxed{" + str(gt) + "}"  # "Give your final answer in \boxed{}."
    if t.qa_type == "multi_choice":
        return ", ".join(str(gt).split(","))  # "separated by commas"
    return str(gt)


def wrong_answer(t: Task) -> str:
    gt = t.ground_truth
    if isinstance(gt, dict):
        return _number(gt["value"] * 2 + 1)
    if t.qa_type in ("single_choice", "multi_choice"):
        return next(x for x in "ABCDE" if x not in str(gt))
    if t.qa_type == "math":
        return "\\boxed{-987654321}"
    if isinstance(gt, int):
        return str(gt + 7)
    return "Xq"


def _exported(tasks: list[Task], tmp: Path) -> list[dict[str, Any]]:
    from flows.rollouts import export_taskset

    path = export_taskset(SimpleNamespace(tasks=tasks), tmp / "taskset.parquet")
    return pq.read_table(path).to_pylist()


def test_every_suites_rows_give_a_correct_answer_full_marks_in_lis_rl_s_reward(lis_rl, tmp_path):
    tasks = [t for name in SUITES if name != "all" for t in build_suite(name)]
    rows = _exported(tasks, tmp_path)
    assert len(rows) == len(tasks)  # no built-in shape is refused
    cases, which = [], []
    for t, row in zip(tasks, rows, strict=True):
        info = row["extra_info"]
        assert info["id"] == t.id and task_from_row(row).ground_truth == t.ground_truth  # exact one beside
        if lis_rl_route(t.domain) == "ifbench":  # a response to the instruction: only the route is checked
            cases.append(("A Response In Title Case.", info))
            which.append((t, "right", ""))
            continue
        for kind, answer in (("right", right_answer(t)), ("wrong", wrong_answer(t))):
            assert score(t, answer).score == (1.0 if kind == "right" else 0.0), (t.id, kind, answer)
            cases.append((answer, info))
            which.append((t, kind, answer))
    results = lis_rl_scores(lis_rl, cases, tmp_path)
    bad, ifbench = [], Counter()
    for (t, kind, answer), res in zip(which, results, strict=True):
        if lis_rl_route(t.domain) == "ifbench":  # the peer's IFBench check is not installable
            assert res.get("score") == 0.0 and "IFBench not found" in res["printed"], (t.id, res)
            ifbench[kind] += 1
            continue
        got = res.get("score")
        if (kind == "right" and got != 1.0) or (kind == "wrong" and not (got is not None and got < 1.0)):
            bad.append((t.id, t.domain, t.qa_type, kind, answer, res, row_gt(rows, t.id)))
    assert not bad, f"{len(bad)} of {len(which)} answers scored wrong by LIS-RL's reward: {bad[:6]}"
    assert ifbench["right"] == sum(1 for t in tasks if t.domain == "instruct_follow") > 0


def row_gt(rows: list[dict[str, Any]], task_id: str) -> str:
    return next(r["extra_info"]["ground_truth"] for r in rows if r["extra_info"]["id"] == task_id)


def test_a_ground_truth_no_route_can_score_is_refused_and_counted(tmp_path):
    ok = Task(id="ok", domain="physics", problem_statement="How far? Answer in metres.",
              ground_truth={"value": 3.5, "unit": "m", "rel_tol": 0.01}, qa_type="numeric")
    # an instruction spec in a domain whose LIS-RL route is math-verify: nothing there reads it
    odd = Task(id="odd", domain="math", problem_statement="Write in title case.", qa_type="instruction",
               ground_truth={"instruction_id_list": ["format:title_case"], "kwargs": [{}]})
    refused: list[tuple[str, str]] = []
    rows = task_rows([odd, ok], lambda t: [{"role": "user", "content": t.problem_statement}], refused=refused)
    assert [r["extra_info"]["id"] for r in rows] == ["ok"] and rows[0]["extra_info"]["index"] == 0
    assert refused == [("odd", "a mapping ground truth (instruction_id_list, kwargs) that its math-verify "
                                "reward cannot read")]
    # the scored text beside sandflow's own: the trainer's row keeps the exact value
    assert rows[0]["extra_info"]["ground_truth"] == "3.5"
    assert json.loads(rows[0]["reward_model"]["ground_truth"]) == ok.ground_truth
    assert task_from_row(rows[0]).ground_truth == ok.ground_truth
    del rows[0]["extra_info"]["ground_truth_json"]  # a trainer that drops our exact copy
    assert task_from_row(rows[0]).ground_truth == ok.ground_truth


@pytest.mark.usefixtures("prefect_harness")
def test_a_default_data_build_s_rows_are_scored_by_lis_rl(lis_rl, tmp_path):
    """8 of 8 rows of a default build failed every LIS-RL read (domain `general`: the
    peer's reward asserts on it); the default is now `instruct_pretrain`, which it routes."""
    from typer.testing import CliRunner

    from sandflow.cli import app
    from tests.datagen.test_build_stages import generator
    from tests.scripted_model import ScriptedModel

    root = _small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    with ScriptedModel(default=generator, models=("scripted",)) as gen:
        res = CliRunner(env={"COLUMNS": "200"}).invoke(app, [
            "data", "build", str(root), "--out", str(out), "--warehouse", str(tmp_path / "wh"),
            "--base-url", gen.url, "--model", "scripted", "--no-calibrate"])
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert rows and {r["extra_info"]["domain"] for r in rows} == {"instruct_pretrain"}
    tasks = [task_from_row(r) for r in rows]
    cases = [(right_answer(t), r["extra_info"]) for t, r in zip(tasks, rows, strict=True)]
    cases += [(wrong_answer(t), r["extra_info"]) for t, r in zip(tasks, rows, strict=True)]
    results = lis_rl_scores(lis_rl, cases, tmp_path)
    n = len(rows)
    assert [r.get("score") for r in results[:n]] == [1.0] * n, results[:n]
    assert all(r.get("score") is not None and r["score"] < 1.0 for r in results[n:]), results[n:]
    card = (out / "README.md").read_text()
    assert "LLM-in-Sandbox-RL" in card and "instruct_pretrain" in card


def _small_corpus(root: Path) -> Path:
    from tests.datagen.corpus_files import BEES, GLACIER, PARIS

    root.mkdir()
    (root / "a_paris.txt").write_text(PARIS + "\n")
    (root / "c_glacier.md").write_text(GLACIER + "\n")
    (root / "d_bees.html").write_text(f"<p>{BEES}</p>")
    return root
