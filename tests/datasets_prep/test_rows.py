"""datasets_prep.rows: the one contract between a row and a Task, both ways.

Issue #22: a list ground truth ("any of these answers") became its JSON text through the
RL rows (`taskset_rows` then `task_from_row`), so every chem "symbol" task scored 0 for a
correct answer; and the math verifier compared with the list's text. Every suite's tasks
go through every row format here and must come back as the same task.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datasets_prep.rows import (
    RowError,
    ground_truth_from_text,
    ground_truth_text,
    row_schema,
    task_from_row,
    task_rows,
)
from datasets_prep.suites import build_suite
from datasets_prep.task import Task
from datasets_prep.verifiers import score

SUITES = {"smoke": None, "math": 10, "chem": 12, "physics": 9, "instruct": 6, "long_context": 3}


def _prompt(t: Task) -> list[dict[str, str]]:
    return [{"role": "user", "content": t.problem_statement}]


def _suite_tasks() -> list[Task]:
    return [t for name, size in SUITES.items() for t in build_suite(name, seed=2, size=size)]


def test_every_suite_task_survives_the_rl_rows_through_parquet(tmp_path: Path) -> None:
    tasks = _suite_tasks()
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(task_rows(tasks, _prompt), schema=row_schema()), path)
    rows = pq.read_table(path).to_pylist()
    back = [task_from_row(r, where=f"row {i}") for i, r in enumerate(rows)]
    differ = [t.id for t, b in zip(tasks, back, strict=True) if t.content_hash != b.content_hash]
    assert not differ, differ
    # the extra_info alone (what rllm hands the environment), and its JSON text
    assert task_from_row(rows[0]["extra_info"]).content_hash == tasks[0].content_hash
    assert task_from_row(json.dumps(rows[0]["extra_info"])).content_hash == tasks[0].content_hash


def test_every_suite_task_survives_the_peer_rows_and_our_task_files(tmp_path: Path) -> None:
    from datasets_prep.io import read_taskset, write_taskset
    from datasets_prep.task import TaskSet

    tasks = _suite_tasks()
    ts = TaskSet.build(tasks, name="all")
    for name in ("ours.parquet", "ours.jsonl"):
        assert read_taskset(write_taskset(ts, tmp_path / name)).content_hash == ts.content_hash
    from tests.datasets_prep.test_suites import gold_answer

    for name in ("peer.parquet", "peer.jsonl"):
        # The peer's row keeps no verifier or metadata and writes ground truths as text:
        # what must survive is the verdict (a list is still "any of", a quantity a quantity).
        back = read_taskset(write_taskset(ts, tmp_path / name, peer=True))
        for t, b in zip(tasks, back, strict=True):
            assert type(b.ground_truth) is type(t.ground_truth) or isinstance(t.ground_truth, int | float)
            if t.qa_type != "instruction":
                assert score(b, gold_answer(t)).score == score(t, gold_answer(t)).score == 1, t.id


def test_a_list_ground_truth_stays_a_list_and_scores_as_any_of() -> None:
    chem = [t for t in build_suite("chem", seed=0, size=12) if t.metadata["kind"] == "symbol"]
    assert chem and all(isinstance(t.ground_truth, list) for t in chem)
    for t in chem:
        [row] = task_rows([t], _prompt)
        back = task_from_row(row)
        assert back.ground_truth == t.ground_truth
        symbol, name = t.ground_truth
        assert score(back, symbol).score == 1 and score(back, f"Answer: {name}").score == 1
        assert score(back, "Xx").score == 0
    # a trainer's row without our exact copy: the text rule still reads a list back
    [row] = task_rows(chem[:1], _prompt)
    del row["extra_info"]["ground_truth_json"]
    assert task_from_row(row).ground_truth == chem[0].ground_truth


def test_every_verifier_reads_a_list_as_any_of_these_answers() -> None:
    def task(qa_type: str, gt: object) -> Task:
        return Task(id="t", domain="x", problem_statement="q", ground_truth=gt, qa_type=qa_type)

    assert score(task("math", ["2", "two"]), "\\boxed{2}").score == 1  # was 0: the list's text
    assert score(task("math", ["1/2", "3"]), "\\boxed{0.5}").score == 1
    assert score(task("math", ["2", "two"]), "\\boxed{5}").score == 0
    assert score(task("numeric", [{"value": 3, "unit": "m"}, 9.5]), "9.5").score == 1
    assert score(task("exact", ["Fe", "iron"]), "IRON").score == 1
    assert score(task("open", ["1/2", "a half"]), "\\boxed{0.5}").score == 1
    r = score(task("math", ["2", "two"]), "\\boxed{7}")
    assert "best of 2 accepted answers" in r.reason
    with pytest.raises(Exception, match="flat list"):
        task("math", [["2"], "3"])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('["Fe", "iron"]', ["Fe", "iron"]),
        ('{"value": 3, "unit": "m"}', {"value": 3, "unit": "m"}),
        ("[1, 2]", "[1, 2]"),  # an interval, not a list of accepted answers
        ("[0, 1)", "[0, 1)"),
        ("42", "42"),
        ("[]", "[]"),
    ],
)
def test_the_one_text_rule(text: str, value: object) -> None:
    assert ground_truth_from_text(text) == value
    if isinstance(value, list):
        assert ground_truth_text(value) == text


def test_a_bad_row_names_the_row_and_field() -> None:
    with pytest.raises(RowError, match="row 3 .*problem_statement"):
        task_from_row({"extra_info": {"id": "a", "domain": "math", "ground_truth": "1"}}, where="row 3")
    with pytest.raises(RowError, match="input_files: text is not a JSON object"):
        task_from_row({"id": "a", "domain": "d", "problem_statement": "q", "ground_truth": "1",
                       "input_files": "not json"})
    with pytest.raises(RowError, match="missing column"):
        task_from_row({"id": "a", "problem_statement": "q"})
