"""Task / TaskSet validation: safe names, sizes, text, ids, content hashes."""

from __future__ import annotations

import dataclasses

import pytest

from datasets_prep import limits as limits_mod
from datasets_prep.task import Task, TaskSet, TaskValidationError, check_file_name, make_task


def set_limits(monkeypatch, **kw):
    monkeypatch.setattr(limits_mod, "LIMITS", dataclasses.replace(limits_mod.LIMITS, **kw))


def _row(**kw):
    base = {"id": "t1", "domain": "math", "problem_statement": "1+1?", "ground_truth": "2"}
    base.update(kw)
    return base


@pytest.mark.parametrize("name", ["../etc/passwd", "a/../../b", "/abs/path.txt", "C:/x.txt", "dir/", "a\\b", ""])
def test_bad_file_names_rejected(name):
    with pytest.raises(TaskValidationError) as e:
        make_task(_row(input_files={name: "x"}), "row 7 (id 't1')")
    assert "row 7" in str(e.value) and "input_files" in str(e.value)


@pytest.mark.parametrize("name", ["doc.txt", "sub/dir/doc.txt", "a..b.txt", ".hidden"])
def test_good_file_names_accepted(name):
    assert check_file_name(name) == name


def test_oversized_file_names_limit(monkeypatch):
    set_limits(monkeypatch, max_file_bytes=1000)
    with pytest.raises(TaskValidationError) as e:
        make_task(_row(input_files={"big.txt": "x" * 1001}), "row 3")
    msg = str(e.value)
    assert "row 3" in msg and "big.txt" in msg and "limit" in msg and "SANDFLOW_MAX_FILE_BYTES" in msg


def test_total_size_limit(monkeypatch):
    set_limits(monkeypatch, max_task_bytes=1500)
    with pytest.raises(TaskValidationError, match="total"):
        make_task(_row(input_files={"a.txt": "x" * 800, "b.txt": b"y" * 800}), "row 0")


@pytest.mark.parametrize("field", ["id", "domain", "problem_statement"])
def test_empty_required_text(field):
    with pytest.raises(TaskValidationError) as e:
        make_task(_row(**{field: "  "}), "row 2")
    assert f"row 2: {field}" in str(e.value)


@pytest.mark.parametrize("gt", [None, "", "   ", [], {}])
def test_empty_ground_truth(gt):
    with pytest.raises(TaskValidationError, match="row 4: .*ground_truth is empty"):
        make_task(_row(ground_truth=gt), "row 4")


def test_instruction_tasks_may_carry_structured_ground_truth():
    t = make_task(_row(qa_type="instruction", ground_truth={"instruction_id_list": ["a"], "kwargs": [{}]}), "r")
    assert t.qa_type == "instruction"


def test_non_utf8_text_rejected():
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")
    with pytest.raises(TaskValidationError, match="row 1: problem_statement: .*UTF-8"):
        make_task(_row(problem_statement=bad), "row 1")
    with pytest.raises(TaskValidationError, match="UTF-8"):
        make_task(_row(input_files={"a.txt": bad}), "row 1")


def test_bytes_files_allowed_and_hash_stable():
    t1 = Task(**_row(input_files={"img.png": b"\x89PNG\x00\xff", "a.txt": "hi"}))
    t2 = Task(**_row(input_files={"a.txt": "hi", "img.png": b"\x89PNG\x00\xff"}))
    assert t1.content_hash == t2.content_hash  # file order does not matter
    t3 = Task(**_row(input_files={"a.txt": "hi!", "img.png": b"\x89PNG\x00\xff"}))
    assert t3.content_hash != t1.content_hash
    assert t1.input_bytes == 8


def test_duplicate_ids_named():
    a, b = Task(**_row()), Task(**_row(problem_statement="other"))
    with pytest.raises(TaskValidationError) as e:
        TaskSet.build([a, Task(**_row(id="t2")), b])
    assert "row 2: id 't1' duplicates row 0" in str(e.value)


def test_taskset_hash_depends_on_content_not_label():
    tasks = [Task(**_row(id=f"t{i}")) for i in range(3)]
    h1 = TaskSet.build(tasks, name="a").content_hash
    h2 = TaskSet.build(list(tasks), name="b", source="elsewhere").content_hash
    assert h1 == h2 and len(h1) == 64
    assert TaskSet.build(tasks[:2]).content_hash != h1


def test_summary_counts():
    ts = TaskSet.build([
        Task(**_row(id="a", qa_type="math")),
        Task(**_row(id="b", domain="chem", qa_type="numeric", input_files={"x.txt": "abc"})),
    ])
    s = ts.summary()
    assert s["count"] == 2 and s["by_domain"] == {"chem": 1, "math": 1}
    assert s["by_type"] == {"math": 1, "numeric": 1} and s["file_bytes"] == 3


def test_peer_row_shape():
    t = Task(**_row(ground_truth={"value": 1}, qa_type="numeric", input_files={"a.txt": "x"}))
    from datasets_prep.rows import peer_row

    row = peer_row(t)
    assert set(row) == {"id", "domain", "problem_statement", "ground_truth", "input_files", "qa_type"}
    assert row["ground_truth"] == '{"value": 1}' and row["input_files"] == {"a.txt": "x"}


# ------------------------------------------------- issue #11: text bounds, UTF-8, secrets
def test_a_50_mb_problem_statement_is_refused_naming_row_field_and_limit():
    with pytest.raises(TaskValidationError) as e:
        make_task(_row(problem_statement="x" * (50 * 1024 * 1024)), "row 9 (id 't1')")
    msg = str(e.value)
    assert msg.startswith("row 9 (id 't1'): problem_statement: the text is 50.0 MB, over the limit of 4.0 MB")
    assert "SANDFLOW_MAX_TEXT_BYTES" in msg and len(msg) < 300


def test_text_limit_counts_utf8_bytes_and_is_configurable(monkeypatch):
    set_limits(monkeypatch, max_text_bytes=10)
    make_task(_row(problem_statement="x" * 10), "row 0")
    with pytest.raises(TaskValidationError, match="problem_statement: the text is 12 B, over the limit of 10 B"):
        make_task(_row(problem_statement="é" * 6), "row 0")  # 6 characters, 12 bytes
    with pytest.raises(TaskValidationError, match="ground_truth: the value is .* over the limit of 10 B"):
        make_task(_row(ground_truth=["aaaa", "bbbb", "cccc"]), "row 0")
    with pytest.raises(TaskValidationError, match="metadata: .*over the limit of 10 B"):
        make_task(_row(metadata={"note": "y" * 20}), "row 0")


def test_the_task_total_counts_text_too(monkeypatch):
    set_limits(monkeypatch, max_task_bytes=100)
    with pytest.raises(TaskValidationError, match=r"row 0: the task \(files and text\) is 125 B, .*SANDFLOW_MAX_TASK_BYTES"):
        make_task(_row(problem_statement="q" * 60, input_files={"a.txt": "x" * 60}), "row 0")


def test_deep_nesting_is_refused_without_recursion_error():
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(TaskValidationError, match="row 1: metadata: .*nested more than 64 levels"):
        make_task(_row(metadata={"x": deep}), "row 1")


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("ground_truth", "4\udcff", "ground_truth: not valid UTF-8"),
        ("metadata", {"k": ["ok", "\ud800"]}, "metadata: metadata['k'][1]: not valid UTF-8"),
        ("metadata", {"\udcff": 1}, "metadata: a key of metadata: not valid UTF-8"),
        ("input_files", {"\udcff.txt": "x"}, "input_files: file name '\\udcff.txt' is not valid UTF-8"),
        ("input_files", {"a\nb.txt": "x"}, "input_files: file name 'a\\nb.txt' contains the control character U+000A"),
        ("qa_type", "exa\udcffct", "qa_type: not valid UTF-8"),
    ],
)
def test_text_that_would_break_the_encoder_is_named(field, value, shown):
    """tasks prepare used to print pyarrow's encoder error without the row or the field."""
    with pytest.raises(TaskValidationError) as e:
        make_task(_row(**{field: value}), "row 5 (id 't1')")
    assert f"row 5 (id 't1'): {shown}" in str(e.value), str(e.value)


SECRET = "sk-issue11-THE-REAL-KEY-0123456789"


@pytest.mark.parametrize("var", ["OPENAI_API_KEY", "SANDFLOW_API_KEY", "HF_TOKEN", "MY_SERVICE_PASSWORD"])
@pytest.mark.parametrize(
    "where, row",
    [
        ("problem_statement", {"problem_statement": f"use {SECRET} please"}),
        ("input_files['env.txt']", {"input_files": {"env.txt": f"A=1\nKEY={SECRET}\n"}}),
        ("input_files['bin']", {"input_files": {"bin": b"\x00" + SECRET.encode() + b"\xff"}}),
        ("ground_truth", {"ground_truth": [SECRET]}),
        ("metadata", {"metadata": {"a": {"b": SECRET}}}),
    ],
)
def test_a_secret_of_the_environment_never_goes_into_a_task(monkeypatch, var, where, row):
    monkeypatch.setenv(var, SECRET)
    with pytest.raises(TaskValidationError) as e:
        make_task(_row(**row), "row 2 (id 't1')")
    msg = str(e.value)
    assert f"row 2 (id 't1'): {where}: holds the value of the environment variable {var}" in msg
    assert SECRET not in msg  # the message names the variable, never the value


def test_short_or_unnamed_values_are_not_secrets(monkeypatch):
    monkeypatch.setenv("SOME_TOKEN", "1")  # a flag, too short to be a key
    monkeypatch.setenv("GREETING", "hello world")  # not a secret name
    t = make_task(_row(problem_statement="hello world 1"), "row 0")
    assert t.problem_statement == "hello world 1"


def test_check_runnable_catches_what_model_construct_let_through(monkeypatch):
    from datasets_prep.task import check_runnable

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    t = Task.model_construct(id="t", domain="d", problem_statement="q", ground_truth=None,
                             input_files={"x.txt": SECRET}, qa_type=None, verifier="auto", metadata={})
    with pytest.raises(TaskValidationError, match=r"task 't': input_files\['x.txt'\]: holds the value of .*OPENAI_API_KEY"):
        check_runnable(t)
    ok = Task.model_construct(id="t", domain="d", problem_statement="q", ground_truth=None,
                              input_files={}, qa_type=None, verifier="auto", metadata={})
    check_runnable(ok)  # no ground truth is fine for an ad-hoc task


@pytest.mark.parametrize("files, folder, name", [
    ({"a": "x", "a/b": "y"}, "a", "a/b"),
    ({"data/c/d.txt": "y", "data": "x"}, "data", "data/c/d.txt"),  # any depth, any order
    ({"docs/x": "1", "docs/x/y/z": "2", "docs/ok.txt": "3"}, "docs/x", "docs/x/y/z"),
])
def test_a_file_that_is_also_a_folder_is_refused_naming_both_paths(files, folder, name):
    """Issue #37: `{"a": ..., "a/b": ...}` cannot be placed in any sandbox (every episode
    failed on it, with the raw OS error); it is refused when the task is built."""
    with pytest.raises(TaskValidationError) as e:
        make_task(_row(input_files=files), "row 4 (id 't1')")
    msg = str(e.value)
    assert msg == (f"row 4 (id 't1'): input_files: input file {folder!r} is also the folder of input "
                   f"file {name!r}: a path cannot be both a file and a folder, so rename one of them")
    # whoever built it: the check before a sandbox gets it names the task
    from datasets_prep.task import check_runnable

    t = Task.model_construct(id="t9", domain="d", problem_statement="q", ground_truth=None,
                             input_files=files, qa_type=None, verifier="auto", metadata={})
    with pytest.raises(TaskValidationError, match=rf"^task 't9': input_files: input file {folder!r} is also"):
        check_runnable(t)
    make_task(_row(input_files={"a.txt": "x", "a/b": "y", "ab/c": "z"}), "row 0")  # no clash


# -------------------------------------- issue #11: a ground truth no verifier can use
@pytest.mark.parametrize(
    "row, says",
    [
        ({"ground_truth": {"a": {"b": 1}}, "domain": "general"}, "'open' verifier (picked for domain 'general') cannot use it"),
        ({"ground_truth": {"a": {"b": 1}}, "qa_type": "exact"}, "'exact' verifier (picked for qa_type 'exact')"),
        ({"ground_truth": [["4"]], "qa_type": "math"}, "'math' verifier"),
        ({"ground_truth": {"value": {"v": 1}}, "qa_type": "numeric"}, "numeric ground truth must be a number"),
        ({"ground_truth": {"value": 1, "rel_tol": "wide"}, "qa_type": "numeric"}, "rel_tol must be a number"),
        ({"ground_truth": "E", "qa_type": "single_choice", "metadata": {"choices": ["a", "b"]}}, "not among the task's 2 options"),
        ({"ground_truth": "A,B", "qa_type": "single_choice"}, "use qa_type multi_choice"),
        ({"ground_truth": {"x": 1}, "qa_type": "multi_choice"}, "must be option letters"),
        ({"ground_truth": {"instruction_id_list": "a"}, "qa_type": "instruction"}, "instruction_id_list must be a non-empty list"),
        ({"ground_truth": {"instruction_id_list": ["a"], "kwargs": [1]}, "qa_type": "instruction"}, "kwargs must be objects"),
        ({"ground_truth": {"x": 1}, "qa_type": "instruction"}, "instruction ground truth must be"),
        ({"ground_truth": {"unit": "m"}, "domain": "chem"}, "'open' verifier"),
        ({"verifier": "nope"}, "unknown verifier 'nope'"),
    ],
)
def test_an_unusable_ground_truth_is_a_verifier_error_at_preparation(row, says):
    from datasets_prep.task import GroundTruthError
    from datasets_prep.verifiers import VerifierError

    with pytest.raises(GroundTruthError) as e:
        make_task(_row(**row), "row 6 (id 't1')")
    assert isinstance(e.value, VerifierError) and isinstance(e.value, TaskValidationError)
    assert str(e.value).startswith("row 6 (id 't1'): ")
    assert says in str(e.value), str(e.value)
