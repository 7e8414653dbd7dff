"""Ingest: every document of a real folder (text, Markdown, HTML, PDF, binary, empty,
undecodable, duplicate, symlinks in and out) is a piece source or a counted rejection."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from datasets_prep.corpus import CorpusError, ingest, reasons_count, split_pieces
from tests.datagen.corpus_files import BEES, PARIS, make_corpus


def test_a_folder_of_documents_is_read_and_every_rejection_counted(tmp_path):
    root = make_corpus(tmp_path / "corpus")
    os.mkfifo(root / "pipe")
    (root / "big.txt").write_text("x" * 5000)
    res = ingest(str(root), max_doc_bytes=4096)
    by_source = {d.source: d for d in res.documents}
    # the symlink inside the folder reads its target, found first (files before folders):
    # the target is then a duplicate of it, never a second copy
    assert set(by_source) == {"paris.txt", "alias.txt", "bees.html", "report.pdf", "mojibake.txt"}
    assert reasons_count(res.rejected) == {
        "binary": 1, "empty": 1, "undecodable": 1, "oversized": 1, "unsafe_path": 1,
        "not_a_file": 1, "duplicate_document": 2,
    }
    assert res.seen == 13  # 11 files of make_corpus + the fifo + big.txt
    why = {r.source: r for r in res.rejected}
    assert why["passwd"].reason == "unsafe_path" and "/etc/passwd" in why["passwd"].detail
    assert why["latin1.txt"].reason == "undecodable" and "0xe9" in why["latin1.txt"].detail
    assert why["paris_copy.txt"].detail == "same text as paris.txt"
    assert why["notes/glacier.md"].detail == "same text as alias.txt"
    text = {p.source: p.text for p in res.pieces}
    assert BEES in text["bees.html"] and "SCRIPT TEXT" not in text["bees.html"]
    assert "menu" not in text["bees.html"]
    assert "Copper conducts electricity" in text["report.pdf"]
    assert "caf\u00e9 opened" in text["mojibake.txt"]  # ftfy repaired the mojibake
    assert text["paris.txt"].strip() == PARIS


def test_pieces_split_by_token_budget_keep_offsets_and_stable_ids():
    doc = "\n\n".join(f"Paragraph {i}. " + "word " * 60 for i in range(10))
    pieces = split_pieces("d-x", "doc.txt", doc, piece_tokens=100)
    assert len(pieces) > 3
    assert all(p.tokens <= 100 for p in pieces)
    assert "".join(doc[p.start : p.end] for p in pieces) == doc
    assert all(doc[p.start : p.end] == p.text for p in pieces)
    again = split_pieces("d-x", "doc.txt", doc, piece_tokens=100)
    assert [p.piece_id for p in pieces] == [p.piece_id for p in again]
    assert len({p.piece_id for p in pieces}) == len(pieces)


def test_a_jsonl_table_with_a_text_column(tmp_path):
    path = tmp_path / "corpus.jsonl"
    rows = [{"text": PARIS}, {"text": ""}, {"text": 7}, {"body": "no text"}, {"text": BEES}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = ingest(str(path))
    assert [d.source for d in res.documents] == ["corpus.jsonl#row0", "corpus.jsonl#row4"]
    assert reasons_count(res.rejected) == {"empty": 2, "binary": 1}
    with pytest.raises(CorpusError, match="no column 'content'"):
        ingest(str(path), text_column="content")


def test_a_malformed_jsonl_line_is_a_counted_row_naming_its_line_and_the_rest_is_read(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"text": PARIS}) + "\n\n" + '{"text": "cut off\n' + "[1, 2]\n"
                    + json.dumps({"text": BEES}) + "\n")
    res = ingest(str(path))
    assert [d.source for d in res.documents] == ["corpus.jsonl#row0", "corpus.jsonl#row3"]
    why = {r.source: (r.reason, r.detail) for r in res.rejected}
    assert why == {
        "corpus.jsonl#row1": ("malformed_row", "line 3: invalid JSON (Unterminated string starting at at column 10)"),
        "corpus.jsonl#row2": ("malformed_row", "line 4: a JSON list, not an object"),
    }
    assert res.seen == 4  # in = out + dropped: nothing lost


def test_an_unreadable_document_is_counted_naming_it(tmp_path):
    """A file (and a folder) the reader may not read: `unreadable`, the others read. As
    root every file is readable, so the ingest runs in a child as an unprivileged user."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="sandflow-unreadable-"))
    try:
        root.chmod(0o755)
        (root / "ok.txt").write_text(PARIS + "\n")
        (root / "secret.txt").write_text(BEES + "\n")
        (root / "secret.txt").chmod(0o000)
        (root / "locked").mkdir()
        (root / "locked" / "inner.txt").write_text("x\n")
        (root / "locked").chmod(0o000)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop root, ingest, report through the pipe
            try:
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                r = ingest(str(root))
                os.write(write, json.dumps([[d.source for d in r.documents],
                                            [[x.source, x.reason, x.detail] for x in r.rejected]]).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            report = f.read()
        os.waitpid(pid, 0)
        docs, rejected = json.loads(report)
    finally:
        for p in (root / "locked", root / "secret.txt"):
            p.chmod(0o700)
        shutil.rmtree(root)
    assert docs == ["ok.txt"]
    assert [(s, r) for s, r, _ in rejected] == [("secret.txt", "unreadable"), ("locked", "unreadable")]
    assert "secret.txt" in rejected[0][2] and "Permission denied" in rejected[0][2]


def test_a_corpus_that_cannot_work_is_one_sentence(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        ingest(str(tmp_path / "nope"))
    (tmp_path / "a.docx").write_bytes(b"PK")
    with pytest.raises(CorpusError, match="is a .docx file"):
        ingest(str(tmp_path / "a.docx"))
