"""The column-mapping converter: context -> files, question -> prompt."""

from __future__ import annotations

import pytest

from datasets_prep.convert import ColumnMapping, convert_rows, split_document
from datasets_prep.task import TaskValidationError


def _doc(sections: int = 6, paras: int = 5) -> str:
    out = []
    for s in range(sections):
        out.append(f"# Section {s}\n\n")
        for p in range(paras):
            out.append(f"Paragraph {s}.{p}. " + "Some words here. " * 40 + "\n\n")
    return "".join(out)


def test_split_is_lossless_and_bounded():
    text = _doc()
    parts = split_document(text, max_chars=4000)
    assert "".join(parts) == text
    assert len(parts) > 1 and all(len(p) <= 4000 for p in parts)


def test_split_prefers_section_then_paragraph_boundaries():
    text = _doc(sections=4, paras=3)
    parts = split_document(text, max_chars=len(text) // 3)
    assert all(p.startswith("# Section") or p.startswith("Paragraph") for p in parts)
    assert all(p.endswith("\n\n") for p in parts[:-1])


def test_split_hard_cuts_one_enormous_line():
    text = "x" * 10_500
    parts = split_document(text, max_chars=1000)
    assert "".join(parts) == text and max(map(len, parts)) <= 1000


def test_short_text_is_one_file():
    assert split_document("short", 100) == ["short"]


def test_convert_places_context_in_files_and_prompt_says_where():
    rows = [{"context": _doc(), "question": "What is in section 3?", "answer": "words"}]
    (t,) = convert_rows(rows, max_chars=5000, domain="general")
    assert len(t.input_files) > 1 and all(n.startswith("document_01_part") for n in t.input_files)
    assert "".join(t.input_files[k] for k in sorted(t.input_files)) == rows[0]["context"]
    assert t.problem_statement.startswith("What is in section 3?")
    assert "/testbed/documents/" in t.problem_statement
    assert "Section 0" not in t.problem_statement  # the context is not inlined
    assert t.qa_type == "open" and t.metadata["question"] == "What is in section 3?"


def test_ids_stable_from_content():
    rows = [{"context": "c", "question": "q", "answer": "a"}, {"context": "c", "question": "q2", "answer": "a"}]
    a = convert_rows(rows, id_prefix="rl")
    b = convert_rows(list(rows), id_prefix="rl")
    assert [t.id for t in a] == [t.id for t in b] and a[0].id != a[1].id and a[0].id.startswith("rl-")


def test_mapping_and_choices():
    m = ColumnMapping.parse("context=passage,question=q,answer=label,choices=options,id=uid,title=name")
    rows = [
        {"uid": "m1", "passage": "Text.", "q": "Pick one", "label": "B", "options": ["x", "y", "z"], "name": "My Doc"},
        {"uid": "m2", "passage": "Text.", "q": "Pick two", "label": [0, 2], "options": '["x", "y", "z"]', "name": "My Doc"},
        {"uid": "m3", "passage": "Text.", "q": "Pick by text", "label": "z", "options": "x | y | z", "name": "My Doc"},
    ]
    t1, t2, t3 = convert_rows(rows, m)
    assert t1.qa_type == "single_choice" and t1.ground_truth == "B" and "B. y" in t1.problem_statement
    assert t2.qa_type == "multi_choice" and t2.ground_truth == "A,C"
    assert t3.ground_truth == "C" and list(t1.input_files) == ["my_doc.txt"]


def test_missing_columns_error_lists_what_exists():
    m = ColumnMapping.parse("question=q,answer=a")
    with pytest.raises(TaskValidationError) as e:
        convert_rows([{"question": "x", "answer": "y"}], m)
    msg = str(e.value)
    assert "question -> 'q'" in msg and "answer -> 'a'" in msg and "the table has: answer, question" in msg


@pytest.mark.parametrize("answer", ["", "   ", None, []])
def test_empty_answer_names_row(answer):
    rows = [{"question": "ok", "answer": "fine"}, {"question": "q", "answer": answer}]
    with pytest.raises(TaskValidationError, match=r"row 1: answer \(answer\): empty"):
        convert_rows(rows)


def test_bad_choice_answer_names_row():
    rows = [{"question": "q", "answer": "Q", "choices": ["a", "b"]}]
    with pytest.raises(TaskValidationError, match=r"row 0: answer \(answer\): answer 'Q' is neither"):
        convert_rows(rows, ColumnMapping(choices="choices"))


def test_bad_mapping_spec():
    with pytest.raises(ValueError, match="unknown mapping role 'contxt'"):
        ColumnMapping.parse("contxt=x")
    with pytest.raises(ValueError, match="not role=column"):
        ColumnMapping.parse("context")


def test_context_path_reads_user_corpus(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Alpha document.\n", encoding="utf-8")
    rows = [{"path": "docs/a.txt", "question": "Which letter?", "answer": "alpha"}]
    (t,) = convert_rows(rows, ColumnMapping(context=None, context_path="path"), base_dir=tmp_path)
    assert t.input_files == {"document_01.txt": "Alpha document.\n"}


def test_context_path_2gb_document_refused_without_reading(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(2 * 1024**3)  # sparse: nothing allocated
    rows = [{"path": "big.txt", "question": "q", "answer": "a"}]
    with pytest.raises(
        TaskValidationError, match=r"row 0: context_path \(column 'path'\): 'big.txt' is 2\.0 GB, over the limit"
    ):
        convert_rows(rows, ColumnMapping(context=None, context_path="path"), base_dir=tmp_path)


def test_context_path_non_utf8(tmp_path):
    (tmp_path / "l1.txt").write_bytes(b"caf\xe9")
    rows = [{"path": "l1.txt", "question": "q", "answer": "a"}]
    with pytest.raises(TaskValidationError, match=r"row 0: context_path \(column 'path'\): 'l1.txt' is not valid UTF-8"):
        convert_rows(rows, ColumnMapping(context=None, context_path="path"), base_dir=tmp_path)


def test_llm_mode_statement_drops_the_sandbox_note():
    (t,) = convert_rows([{"context": "Some text.", "question": "What is it?", "answer": "text"}])
    assert "/testbed/documents/" in t.statement("sandbox")
    assert t.statement("llm") == "What is it?"


# ---------------------------------- issue #11: context_path stays inside the table's folder
@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-issue11-context-path-KEY-000111")
    (tmp_path / "secret.txt").write_text("TOP SECRET")
    table = tmp_path / "table"
    (table / "docs").mkdir(parents=True)
    (table / "docs" / "a.txt").write_text("Alpha.\n")
    return table


@pytest.mark.parametrize(
    "value, says",
    [
        ("../secret.txt", "contains '..'"),
        ("docs/../../secret.txt", "contains '..'"),
        ("/proc/self/environ", "is an absolute path"),
        ("/etc/passwd", "is an absolute path"),
        ("link_out", "leads to"),
        ("rel_link_out", "leads to"),
        ("dir_out/secret.txt", "leads to"),
        ("env_link", "leads to '/proc/"),
    ],
)
def test_context_path_outside_the_table_folder_is_refused(corpus, value, says):
    (corpus / "link_out").symlink_to(corpus.parent / "secret.txt")
    (corpus / "rel_link_out").symlink_to("docs/../../secret.txt")
    (corpus / "dir_out").symlink_to(corpus.parent)
    (corpus / "env_link").symlink_to("/proc/self/environ")
    rows = [{"path": "docs/a.txt", "question": "q0", "answer": "a"},
            {"path": value, "question": "q1", "answer": "a"}]
    with pytest.raises(TaskValidationError) as e:
        convert_rows(rows, ColumnMapping(context=None, context_path="path"), base_dir=corpus)
    msg = str(e.value)
    assert msg.startswith(f"row 1: context_path (column 'path'): '{value}'"), msg
    assert says in msg and "TOP SECRET" not in msg and "sk-issue11" not in msg


def test_context_path_needs_a_table_folder():
    rows = [{"path": "a.txt", "question": "q", "answer": "a"}]
    with pytest.raises(TaskValidationError, match="row 0: context_path .*this source has none"):
        convert_rows(rows, ColumnMapping(context=None, context_path="path"))


def test_context_path_symlinks_inside_the_folder_are_followed(corpus):
    (corpus / "alias.txt").symlink_to("docs/a.txt")
    rows = [{"path": "alias.txt", "question": "q", "answer": "a"}]
    (t,) = convert_rows(rows, ColumnMapping(context=None, context_path="path"), base_dir=corpus)
    assert list(t.input_files.values()) == ["Alpha.\n"]


def test_a_document_holding_a_secret_is_refused(corpus):
    (corpus / "docs" / "env.txt").write_text("OPENAI_API_KEY=sk-issue11-context-path-KEY-000111\n")
    rows = [{"path": "docs/env.txt", "question": "q", "answer": "a"}]
    with pytest.raises(TaskValidationError) as e:
        convert_rows(rows, ColumnMapping(context=None, context_path="path"), base_dir=corpus)
    assert "row 0 (id " in str(e.value) and "holds the value of the environment variable OPENAI_API_KEY" in str(e.value)
    assert "sk-issue11" not in str(e.value)
