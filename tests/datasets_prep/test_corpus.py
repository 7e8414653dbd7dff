"""Ingest: every document of a real folder (text, Markdown, HTML, PDF, binary, empty,
undecodable, duplicate, symlinks in and out) is a piece source or a counted rejection."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from datasets_prep.corpus import Boilerplate, CorpusError, ingest, reasons_count, split_pieces
from tests.datagen.corpus_files import BEES, GLACIER, PARIS, make_corpus


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


def test_a_folder_symlink_is_counted_not_skipped_silently(tmp_path):
    """Issue #37: `loop -> .` was skipped without a word; it is a counted rejection now."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "paris.txt").write_text(PARIS + "\n")
    (root / "sub" / "bees.txt").write_text(BEES + "\n")
    (root / "loop").symlink_to(".")
    (root / "again").symlink_to("sub")
    res = ingest(str(root))
    assert sorted(d.source for d in res.documents) == ["paris.txt", "sub/bees.txt"]
    why = {r.source: (r.reason, r.detail) for r in res.rejected}
    assert set(why) == {"loop", "again"}
    assert why["loop"][0] == why["again"][0] == "linked_folder"
    assert "'.'" in why["loop"][1] and "'sub'" in why["again"][1]
    assert res.seen == 4  # every path of the folder: read, or counted with its reason


# ----------------------------------------------------------------- HTML as a reader sees it
SPHINX_PAGE = Path("/usr/share/doc/python3.11/html/library/json.html")  # python3.11-doc (setup.sh)


def _rendered_paragraphs(html: str) -> list[str]:
    """The page's paragraphs as a browser shows them, derived without the extractor: each
    <p> of the Sphinx body, its text nodes joined and its whitespace folded."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(html)
    for n in tree.css("a.headerlink"):
        n.decompose()
    body = tree.css_first("div.body")
    assert body is not None
    return [t for p in body.css("p") if (t := " ".join(p.text(deep=True).split()))]


def test_a_sphinx_page_reads_as_a_reader_sees_it(tmp_path):
    """Issue #36: prose joined across inline elements, <pre> verbatim, Sphinx's chrome
    (breadcrumbs, sidebar, footer, the "¶" links) gone, on a page of the Python docs."""
    from selectolax.lexbor import LexborHTMLParser

    html = SPHINX_PAGE.read_text(encoding="utf-8")
    root = tmp_path / "docs"
    root.mkdir()
    shutil.copyfile(SPHINX_PAGE, root / "json.html")
    res = ingest(str(root))
    assert [d.source for d in res.documents] == ["json.html"]
    text = "".join(p.text for p in res.pieces)
    assert ("JSON (JavaScript Object Notation), specified by RFC 7159 (which obsoletes RFC 4627) "
            "and by ECMA-404, is a lightweight data interchange format") in text
    assert "Serialize obj as a JSON formatted stream to fp (a .write()-supporting file-like object)" in text
    for pre in LexborHTMLParser(html).css("pre"):
        assert pre.text(deep=True).strip("\n") in text
    for chrome in ("\u00b6", "Previous topic", "Next topic", "This Page", "Report a Bug",
                   "Show Source", "Copyright", "Python Software Foundation", "Last updated on",
                   "Created using", "Internet Data Handling \u00bb", "Table of Contents"):
        assert chrome not in text, chrome
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert not [ln for ln in lines if ln.startswith((", ", ". ", ") "))]  # no sentence cut at a link
    assert sum(len(ln.strip()) <= 3 for ln in lines) / len(lines) < 0.1  # code braces; was a third


def test_the_evidence_check_accepts_the_sentences_a_browser_shows(tmp_path):
    """Every paragraph of the page as rendered, quoted as evidence, passes the synth
    stage's own lexical check against the pieces ingest cut (26% were rejected)."""
    from datagen.questions import supported

    root = tmp_path / "docs"
    root.mkdir()
    shutil.copyfile(SPHINX_PAGE, root / "json.html")
    pieces = [p.text for p in ingest(str(root)).pieces]
    paragraphs = _rendered_paragraphs(SPHINX_PAGE.read_text(encoding="utf-8"))
    assert len(paragraphs) > 50
    rejected = [s for s in paragraphs if not any(supported("", s, t) is None for t in pieces)]
    assert rejected == []


def test_boilerplate_that_repeats_across_documents_is_removed_and_counted(tmp_path):
    footer = "Copyright 2026 Example Corp. All rights reserved. Subscribe to our newsletter."
    cookie = "<div class='notice'>We use cookies to improve your experience on this site.</div>"
    root = tmp_path / "site"
    root.mkdir()
    bodies = [PARIS, BEES, "The Rhine rises in the Swiss Alps and flows to the North Sea.",
              "Copper conducts electricity better than iron does, and costs more."]
    for i, body in enumerate(bodies):
        (root / f"page{i}.txt").write_text(f"See also\n\n{body}\n\n{footer}\n")
    (root / "page4.html").write_text(
        f"<html><body><div><p>{GLACIER}</p></div>{cookie}<div>{footer}</div></body></html>")
    (root / "only_footer.txt").write_text(f"\n{footer}\n")
    (root / "shared_by_two.txt").write_text(f"{PARIS}\n\nThe Pont Neuf is the oldest bridge.\n")
    res = ingest(str(root))
    text = {p.source: p.text for p in res.pieces}
    assert all("Example Corp" not in t for t in text.values())
    assert text["page0.txt"].strip() == f"See also\n\n{PARIS}"  # a label is not boilerplate
    assert GLACIER in text["page4.html"]
    assert "oldest bridge" in text["shared_by_two.txt"]  # in 2 of 7 documents: content
    why = {r.source: (r.reason, r.detail) for r in res.rejected}
    assert why["only_footer.txt"][0] == "boilerplate"
    # PARIS is a block of 2 documents (under the share): kept, and shared_by_two is not a
    # duplicate of page0 (it holds another paragraph too)
    assert res.boilerplate["removed"] == 6 and res.boilerplate["documents"] == 6
    assert res.boilerplate["blocks"] == 1 and res.boilerplate["chars"] > 6 * len(footer)
    kept_off = ingest(str(root), boilerplate=Boilerplate(min_share=0))
    assert sum("Example Corp" in p.text for p in kept_off.pieces) == 6


def test_a_page_over_the_search_bound_is_rendered_whole_without_its_chrome(monkeypatch):
    """trafilatura's search costs ~8 s a MB: a larger page is rendered from the cleaned
    HTML alone, still joined, verbatim and without chrome."""
    import datasets_prep.corpus as corpus

    page = ("<html><body><nav>Home | Blog</nav><div class='related'>Python \u00bb</div>"
            + "<p>The <a href='#'>Seine</a> flows <b>through</b> Paris.</p>" * 3
            + "<pre>def f():\n\n    return 1\n</pre></body></html>").encode()
    monkeypatch.setattr(corpus, "MAX_SEARCH_BYTES", 100)
    assert corpus.html_text(page) == "\n\n".join(["The Seine flows through Paris."] * 3
                                                  + ["def f():\n\n    return 1"])
