"""Raw general-domain text -> pieces with stable ids: the ingest stage of an RL data build.

Sources: a folder of documents (text, Markdown, HTML, PDF), a table file with a text
column (JSONL, JSON, Parquet, CSV), or `hf:NAME[:CONFIG][@SPLIT]` through the loader
every task set uses (datasets_prep.loaders). Text is normalised with ftfy (mojibake,
odd quotes, Unicode forms) and newlines are unified; a long document is split by a
token budget at section, paragraph or line boundaries (convert.split_document: the
pieces join back into the document exactly), and each piece keeps its document id,
its source and its character offsets into the normalised document.

Ids are content hashes, so the same corpus always gives the same ids and a re-run
reuses what was done: a document is `d-` + sha256(normalised text), a piece `p-` +
sha256(document id, offsets, text).

A document that cannot be used never stops the build and never vanishes: it is
counted with one reason (`REASONS`) and a detail naming it. A folder is walked
without following anything: a symlink that leads outside the folder is refused
(`unsafe_path`), a symlink to a file inside is read as that file, a symlink to a folder
is not followed (it could loop: `loop -> .`) and is counted as `linked_folder` (its
files are read under their own names), and files are opened through
datasets_prep.paths (O_NOFOLLOW, the opened fd checked to be inside, bounded reads).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets_prep import limits as L
from datasets_prep.convert import split_document
from datasets_prep.paths import (
    UnreadablePathError,
    UnsafePathError,
    WalkEntry,
    folder_to_walk,
    open_regular,
    read_fd,
    show,
    walk_folder,
)

# Why a document was left out (the funnel's reasons for the ingest stage).
REASONS = (
    "binary",  # NUL bytes, or a file type that holds no text (images, archives, ...)
    "empty",  # nothing left after extraction and normalisation
    "undecodable",  # not UTF-8 (nor UTF-16 with a BOM)
    "oversized",  # over the per-document size bound
    "unsafe_path",  # a symlink leading outside the folder, a name that is not UTF-8, ...
    "not_a_file",  # a fifo, socket or device
    "extract_failed",  # the HTML/PDF extractor failed on it
    "duplicate_document",  # the same normalised text as an earlier document
    "unreadable",  # the file or folder cannot be read (permissions, an I/O error)
    "malformed_row",  # a line of a JSON Lines table that is not one JSON object
    "linked_folder",  # a symlink to a folder inside the corpus: not followed (loops)
    "boilerplate",  # every block of it repeats across the corpus's documents (Boilerplate)
)

TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".org", ".tex", ".csv", ".tsv"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})
PDF_SUFFIXES = frozenset({".pdf"})
TABLE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".pq", ".csv", ".tsv")
BINARY_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".ico", ".zip", ".gz", ".bz2", ".xz",
     ".tar", ".7z", ".exe", ".so", ".dll", ".bin", ".pyc", ".mp3", ".mp4", ".wav", ".ogg"}
)  # fmt: skip

CHARS_PER_TOKEN = 4  # the token estimate of the budget: documented, model independent
DEFAULT_PIECE_TOKENS = 1024


@dataclass(frozen=True)
class Piece:
    """A span of a normalised document: the unit questions are written from."""

    piece_id: str
    doc_id: str
    source: str
    start: int
    end: int
    tokens: int
    text: str


@dataclass(frozen=True)
class Rejected:
    """A document left out, with its reason (one of REASONS) and what was wrong."""

    source: str
    reason: str
    detail: str


@dataclass
class Document:
    source: str
    doc_id: str
    chars: int
    pieces: int


@dataclass
class IngestResult:
    """What ingest saw: every document is either in `documents` or in `rejected`."""

    documents: list[Document] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    # cross-document boilerplate removed: the rule, distinct blocks, blocks removed,
    # characters removed, documents touched (Boilerplate)
    boilerplate: dict[str, Any] = field(default_factory=dict)

    @property
    def seen(self) -> int:
        return len(self.documents) + len(self.rejected)


class CorpusError(ValueError):
    """The corpus itself cannot be read (no such folder, a table without the text column):
    one sentence naming it, raised before any work."""


def estimate_tokens(text: str) -> int:
    """Tokens of `text` by the budget's estimate (CHARS_PER_TOKEN characters a token)."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def normalise(text: str) -> str:
    """ftfy's repairs (mojibake, NFC), unified newlines, no NUL. Curly quotes are kept
    (ftfy straightens them by default): the text stays as a reader sees it, so evidence
    quoted from the page as shown is found in it."""
    import ftfy

    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    return ftfy.fix_text(text, normalization="NFC", uncurl_quotes=False)


def doc_id_of(text: str) -> str:
    return "d-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def piece_id_of(doc_id: str, start: int, end: int, text: str) -> str:
    h = hashlib.sha256(f"{doc_id}:{start}:{end}:".encode())
    h.update(text.encode("utf-8", "surrogatepass"))
    return "p-" + h.hexdigest()[:16]


def split_pieces(doc_id: str, source: str, text: str, piece_tokens: int) -> list[Piece]:
    """Pieces of at most ~piece_tokens (estimated) with their offsets; they join back
    into `text` exactly. Whitespace-only pieces are folded into the previous one."""
    max_chars = max(1, piece_tokens * CHARS_PER_TOKEN)
    out: list[Piece] = []
    pos = 0
    for chunk in split_document(text, max_chars):
        start, pos = pos, pos + len(chunk)
        if not chunk.strip():
            continue
        out.append(Piece(piece_id_of(doc_id, start, pos, chunk), doc_id, source, start, pos,
                         estimate_tokens(chunk), chunk))
    return out


# ----------------------------------------------------------------------- extraction
class _Reject(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def decode_text(data: bytes) -> str:
    """UTF-8 (a BOM allowed), or UTF-16 with its BOM; NUL bytes mean binary."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise _Reject("undecodable", f"not valid UTF-16 (byte offset {e.start})") from None
    if b"\x00" in data[:8192]:
        raise _Reject("binary", "holds NUL bytes: not a text document")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _Reject(
            "undecodable", f"not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def html_text(data: bytes) -> str:
    """The main content of an HTML page as a reader sees it: one block a paragraph
    (heading, list item, table row) with its inline text joined, `<pre>` verbatim, and
    the site's chrome left out.

    selectolax (lexbor) first removes what is never content: scripts, styles, the head,
    navigation and footers (by tag and by ARIA role) and the chrome of Sphinx sites
    (`CHROME_SELECTORS`); every `<pre>` is marked as code so that it stays verbatim.
    A page that names its main content (`<main>`, `role="main"`) is cut to it, its links
    and asides unwrapped (a table of contents and footnotes are content there). trafilatura
    then finds the main content (menus, share bars, comments and other boilerplate of
    sites sandflow knows nothing about); its tree is rendered by `render_blocks`. A page
    trafilatura finds no main content in (a page of one short paragraph), or one over
    MAX_SEARCH_BYTES, is rendered whole from the cleaned HTML. (trafilatura's search
    keeps one of identical paragraphs where it recovers text outside an article frame.)"""
    from selectolax.lexbor import LexborHTMLParser

    html = decode_text(data)
    try:
        tree = LexborHTMLParser(html)
        for node in tree.css(", ".join(CHROME_SELECTORS)):
            node.decompose()
        for pre in tree.css("pre"):  # one span: trafilatura keeps it as code, verbatim
            pre.inner_html = "<span>" + _escape(pre.text(deep=True)) + "</span>"
        main = tree.css_first("[role=main]") or tree.css_first("main")
        if main is not None:  # the page names its content: all of it is, link lists too
            for node in main.css("a, aside"):  # asides there are footnotes and side notes
                node.unwrap()
            cleaned = "<html><body>" + (main.html or "") + "</body></html>"
        else:
            cleaned = tree.html or ""
    except Exception as e:  # lexbor on hostile markup: counted, never fatal
        raise _Reject("extract_failed", f"HTML extraction failed: {type(e).__name__}: {e}") from None
    if not cleaned.strip():
        return ""
    return "\n\n".join(render_blocks(_main_content(cleaned, search=len(cleaned) <= MAX_SEARCH_BYTES)))


# trafilatura's main-content search costs ~8 s a MB of HTML here (a 64 MB file: minutes);
# a larger page (a book in one file) is rendered whole once its chrome is removed.
MAX_SEARCH_BYTES = 2_000_000


# Never a page's content: removed before the main content is looked for. Sphinx (the
# Python documentation and most project documentation) puts its chrome in classed divs,
# not in <nav>/<footer>: the breadcrumb bar, the sidebar, the footer and the "¶" links.
CHROME_SELECTORS = (
    "script", "style", "noscript", "template", "svg", "head", "nav", "footer",
    "form", "button", "iframe", "[hidden]", "[aria-hidden=true]",
    "[role=navigation]", "[role=search]", "[role=contentinfo]", "[role=banner]",
    "div.related", "div.sphinxsidebar", "div.footer", "a.headerlink",
)  # fmt: skip


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _main_content(html: str, *, search: bool = True) -> Any:
    """trafilatura's main-content tree of `html` (its TEI-like elements: p, head, list,
    item, table, row, cell, code, quote, hi, ref, lb), or lxml's whole body when
    trafilatura finds none (or `search` is off). Its log lines ("discarding data: None")
    name no file and are kept off the terminal: what it could not use is counted here."""
    import logging

    import lxml.html
    import trafilatura

    logging.getLogger("trafilatura").setLevel(logging.ERROR)

    doc = None
    try:
        if search:
            doc = trafilatura.bare_extraction(
                html, favor_recall=True, include_comments=False, include_tables=True,
                include_images=False, include_links=False, deduplicate=False, with_metadata=False,
                config=_trafilatura_config(),
            )
    except Exception:  # its heuristics on odd markup: the whole cleaned page instead
        doc = None
    body = getattr(doc, "body", None)
    if body is not None and len(body):
        return body
    try:
        root = lxml.html.document_fromstring(html)
    except Exception as e:
        raise _Reject("extract_failed", f"HTML extraction failed: {type(e).__name__}: {e}") from None
    found = root.find("body")
    return found if found is not None else root


@functools.lru_cache(maxsize=1)
def _trafilatura_config() -> Any:
    """trafilatura's defaults without its signal-based timeout (ingest may run in a
    worker thread) and with no minimum size: a short page is content too."""
    from trafilatura.settings import DEFAULT_CONFIG

    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["DEFAULT"]["EXTRACTION_TIMEOUT"] = "0"
    cfg["DEFAULT"]["MIN_EXTRACTED_SIZE"] = "1"
    cfg["DEFAULT"]["MIN_OUTPUT_SIZE"] = "1"
    return cfg


# Elements that start a block of their own: trafilatura's output vocabulary and HTML's.
_BLOCKS = frozenset(
    ["p", "head", "quote", "item", "list", "table", "row", "cell", "main", "body", "doc", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "ul", "ol", "dl", "dt", "dd", "tr", "td", "th", "thead", "tbody", "tfoot", "caption", "blockquote", "section", "article", "header", "figure", "figcaption", "address", "details", "summary", "hr", "center"]
)
_ROWS = frozenset({"row", "tr"})
_BREAKS = frozenset({"lb", "br"})


def render_blocks(root: Any) -> list[str]:
    """The blocks of an element tree as a reader sees them: a block's inline text joined
    with its whitespace folded (a line break only at <br>), code (`<pre>`, or
    trafilatura's block `<code>`) verbatim, a table row's cells on one line."""
    out: list[str] = []
    run: list[str] = []

    def flush() -> None:
        text = "".join(run)
        run.clear()
        joined = "\n".join(" ".join(line.split()) for line in text.split("\x01"))
        joined = joined.strip()
        if joined:
            out.append(joined)

    def inline(el: Any) -> None:  # an inline element's text into the current run
        if el.tag in _BREAKS:
            run.append("\x01")
        else:
            run.append(el.text or "")
            for child in el:
                if isinstance(child.tag, str):
                    inline(child)
                run.append(child.tail or "")

    def is_code_block(el: Any, before: str) -> bool:
        if el.tag == "pre":
            return True
        return el.tag == "code" and not before.strip() and not (el.tail or "").strip()

    def block(el: Any) -> None:
        if el.tag in _ROWS:
            flush()
            cells = []
            for cell in el:
                if isinstance(cell.tag, str):
                    inline(cell)
                    cells.append(" ".join("".join(run).replace("\x01", " ").split()))
                    run.clear()
            line = " | ".join(c for c in cells if c)
            if line:
                out.append(line)
            return
        run.append(el.text or "")
        for child in el:
            if not isinstance(child.tag, str):  # a comment or processing instruction
                run.append(child.tail or "")
                continue
            if is_code_block(child, "".join(run)):
                flush()
                code = "".join(child.itertext()).strip("\n")
                if code.strip():
                    out.append(code)
            elif child.tag in _BLOCKS:
                flush()
                block(child)
                flush()
            else:
                inline(child)
            run.append(child.tail or "")
        flush()

    block(root)
    return out


def pdf_text(data: bytes, max_pages: int = 2000) -> str:
    """The text layer of a PDF (pypdf), page by page; a PDF without one is empty. pypdf's
    own warnings ("EOF marker not found") are kept off the terminal: they name no file,
    and a PDF it cannot read is counted as extract_failed with the error as its detail."""
    import io
    import logging

    from pypdf import PdfReader

    logging.getLogger("pypdf").setLevel(logging.ERROR)

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise _Reject("extract_failed", "the PDF is encrypted")
        pages = []
        for i, page in enumerate(reader.pages):
            if i >= max_pages:
                break
            pages.append(page.extract_text() or "")
    except _Reject:
        raise
    except Exception as e:
        raise _Reject("extract_failed", f"PDF extraction failed: {type(e).__name__}: {e}") from None
    return "\n\n".join(p.strip() for p in pages if p.strip())


def extract(name: str, data: bytes) -> str:
    """Text of one file by its suffix; an unknown suffix is read as text if it is text."""
    suffix = os.path.splitext(name)[1].lower()
    if suffix in BINARY_SUFFIXES:
        raise _Reject("binary", f"a {suffix} file holds no text")
    if suffix in HTML_SUFFIXES:
        return html_text(data)
    if suffix in PDF_SUFFIXES or data.startswith(b"%PDF-"):
        return pdf_text(data)
    return decode_text(data)


# ------------------------------------------------------------------------- sources
@dataclass
class RawDocument:
    source: str
    text: str | None = None
    reject: Rejected | None = None


_WALK_REASONS = {
    "unlistable": "unreadable", "bad_name": "unsafe_path", "stat_error": "unreadable",
    "link_outside": "unsafe_path", "link_broken": "unsafe_path", "special": "not_a_file",
}  # fmt: skip


def _walk_detail(e: WalkEntry) -> str:
    return {
        "unlistable": f"cannot list the folder ({e.detail})",
        "bad_name": f"the file name {e.detail}",
        "link_outside": f"a symlink to {e.detail!r}, outside the corpus folder",
        "link_broken": f"a symlink that cannot be followed ({e.detail})",
        "special": f"{e.detail}, not a regular file",
    }.get(e.kind, e.detail)


def iter_folder(root: str | Path, max_bytes: int) -> Iterator[RawDocument]:
    """Every file under `root` (sorted, files before subfolders) as text or as a rejection:
    datasets_prep.paths walks it (nothing followed out of it) and opens each file."""
    try:
        real_root = folder_to_walk(root, "corpus folder")
    except UnsafePathError as err:
        raise CorpusError(str(err)) from None
    for e in walk_folder(real_root):
        rel = show(e.rel).strip("'")
        if e.kind == "dir":
            continue  # a folder's files come as their own entries
        if e.kind == "link_dir":  # not followed (it could loop), but never silently
            yield RawDocument(rel, reject=Rejected(rel, "linked_folder", (
                f"a symlink to the folder {e.detail!r} inside the corpus: not followed "
                "(its files are read under their own path)")))
            continue
        if e.kind != "file":
            yield RawDocument(rel, reject=Rejected(rel, _WALK_REASONS[e.kind], _walk_detail(e)))
            continue
        assert e.st is not None
        if e.st.st_size > max_bytes:
            yield RawDocument(rel, reject=Rejected(
                rel, "oversized", L.over_limit(rel, e.st.st_size, "max_file_bytes", "per file")))
            continue
        try:
            fd = open_regular(e.path, root=real_root, expect=e.st)
            try:
                data = read_fd(fd, max_bytes, rel, "max_file_bytes", "per file")
            finally:
                os.close(fd)
        except UnreadablePathError as bad:
            yield RawDocument(rel, reject=Rejected(rel, "unreadable", str(bad)))
            continue
        except UnsafePathError as bad:
            yield RawDocument(rel, reject=Rejected(rel, "unsafe_path", str(bad)))
            continue
        except OSError as bad:  # an I/O error while reading: this document, not the build
            yield RawDocument(rel, reject=Rejected(rel, "unreadable", f"{rel!r} cannot be read: {bad.strerror}"))
            continue
        try:
            yield RawDocument(rel, text=extract(e.rel, data))
        except _Reject as r:
            yield RawDocument(rel, reject=Rejected(rel, r.reason, r.detail))


def iter_table(source: str, text_column: str, max_bytes: int,
               limit: int | None = None) -> Iterator[RawDocument]:
    """Rows of a table file or `hf:` dataset, the text in `text_column`."""
    from datasets_prep.loaders import SourceError, load_rows

    label = source if source.startswith("hf:") else Path(source).name
    try:
        if _is_json_lines(source):
            rows: list[Any] = _json_lines(Path(source), label, limit)
        else:
            rows = load_rows(source, limit=limit)
    except SourceError as e:
        raise CorpusError(str(e)) from None
    first = next((r for r in rows if not isinstance(r, Rejected)), None)
    if first is not None and text_column not in first:
        raise CorpusError(
            f"{source!r} has no column {text_column!r} (its columns: "
            f"{', '.join(sorted(map(str, first)))}); name the text column with --text-column"
        )
    for i, row in enumerate(rows):
        where = f"{label}#row{i}"
        if isinstance(row, Rejected):
            yield RawDocument(row.source, reject=row)
            continue
        value = row.get(text_column)
        if value is None:
            yield RawDocument(where, reject=Rejected(where, "empty", f"no value in {text_column!r} (missing or null)"))
        elif isinstance(value, bytes):
            if len(value) > max_bytes:
                yield RawDocument(where, reject=Rejected(
                    where, "oversized", L.over_limit(where, len(value), "max_file_bytes", "per file")))
                continue
            try:
                yield RawDocument(where, text=decode_text(value))
            except _Reject as r:
                yield RawDocument(where, reject=Rejected(where, r.reason, r.detail))
        elif not isinstance(value, str):
            yield RawDocument(where, reject=Rejected(
                where, "binary", f"{text_column!r} holds a value of type {type(value).__name__}, not text"))
        elif len(value) > max_bytes:
            yield RawDocument(where, reject=Rejected(
                where, "oversized", L.over_limit(where, len(value), "max_file_bytes", "per file")))
        else:
            yield RawDocument(where, text=value)


def _is_json_lines(source: str) -> bool:
    """A local JSON Lines file (.jsonl, .ndjson; a .json file may be one array: the
    table loader reads it whole)."""
    p = Path(source)
    return not source.startswith("hf:") and p.suffix.lower() in (".jsonl", ".ndjson") and p.is_file()


def _json_lines(path: Path, label: str, limit: int | None) -> list[Any]:
    """The rows of a JSON Lines corpus; a line that is not one JSON object is a
    `malformed_row` naming its line (the other rows are read: one bad line of a
    million-row corpus does not stop the build, and is counted)."""
    import json

    from datasets_prep.loaders import SourceError

    try:
        data = path.read_bytes()
    except OSError as e:
        raise SourceError(f"{str(path)!r} cannot be read: {e.strerror}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SourceError(f"{str(path)!r} is not UTF-8 (byte {data[e.start]:#04x} at offset {e.start})") from None
    rows: list[Any] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if limit is not None and len(rows) >= limit:
            break
        where = f"{label}#row{len(rows)}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            rows.append(Rejected(where, "malformed_row", f"line {n}: invalid JSON ({e.msg} at column {e.colno})"))
            continue
        except RecursionError:
            rows.append(Rejected(where, "malformed_row", f"line {n}: JSON nested too deeply"))
            continue
        if not isinstance(obj, dict):
            rows.append(Rejected(where, "malformed_row", f"line {n}: a JSON {type(obj).__name__}, not an object"))
            continue
        rows.append(obj)
    return rows


def is_table_source(source: str) -> bool:
    return source.startswith("hf:") or (
        Path(source).suffix.lower() in TABLE_SUFFIXES and Path(source).is_file()
    )


def check_source(source: str) -> None:
    """Raise CorpusError (one sentence naming it) when `source` cannot be a corpus."""
    if source.startswith("hf:"):
        return
    p = Path(source)
    if not p.exists():
        raise CorpusError(f"corpus {source!r} does not exist (a folder, a table file or hf:NAME)")
    if p.is_file() and p.suffix.lower() not in TABLE_SUFFIXES:
        raise CorpusError(
            f"corpus {source!r} is a {p.suffix or 'suffix-less'} file; give a folder of documents "
            f"or a table ({', '.join(TABLE_SUFFIXES)}) with a text column"
        )


def ingest(
    source: str,
    *,
    text_column: str = "text",
    piece_tokens: int = DEFAULT_PIECE_TOKENS,
    max_doc_bytes: int | None = None,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
    boilerplate: Boilerplate | None = None,
) -> IngestResult:
    """Read a corpus into pieces; every document ends up in `documents` or `rejected`.

    Two passes: every document is read and normalised first, then the blocks that repeat
    across the corpus's documents (`Boilerplate`; `Boilerplate(min_share=0)` keeps them)
    are removed, and then documents get their ids, duplicates are found and pieces cut."""
    if piece_tokens < 16:
        raise CorpusError(f"piece tokens {piece_tokens}: use at least 16")
    check_source(source)
    max_bytes = max_doc_bytes or L.LIMITS.max_file_bytes
    raw: Iterable[RawDocument] = (
        iter_table(source, text_column, max_bytes, limit) if is_table_source(source)
        else iter_folder(source, max_bytes)
    )
    out = IngestResult()
    texts: list[tuple[str, str]] = []  # (source, normalised text), in corpus order
    for n, doc in enumerate(raw):
        if limit is not None and n >= limit:
            break
        if progress is not None:
            progress(n + 1)
        if doc.reject is not None:
            out.rejected.append(doc.reject)
            continue
        text = normalise(doc.text or "")
        if not text.strip():
            out.rejected.append(Rejected(doc.source, "empty", "no text after extraction"))
            continue
        texts.append((doc.source, text))
    rule = boilerplate if boilerplate is not None else Boilerplate()
    repeated = rule.find(t for _, t in texts)
    removed: dict[str, Any] = {"rule": str(rule), "blocks": len(repeated), "removed": 0, "chars": 0,
                               "documents": 0}
    seen: dict[str, str] = {}
    for src, text in texts:
        if repeated:
            stripped, n_removed = rule.strip(text, repeated)
            if n_removed:
                removed["removed"] += n_removed
                removed["chars"] += len(text) - len(stripped)
                removed["documents"] += 1
                if not stripped.strip():
                    out.rejected.append(Rejected(
                        src, "boilerplate", f"every block of it repeats across the corpus ({rule})"))
                    continue
                text = stripped
        did = doc_id_of(text)
        if did in seen:
            out.rejected.append(Rejected(src, "duplicate_document", f"same text as {seen[did]}"))
            continue
        seen[did] = src
        pieces = split_pieces(did, src, text, piece_tokens)
        out.pieces.extend(pieces)
        out.documents.append(Document(src, did, len(text), len(pieces)))
    out.boilerplate = removed
    return out


_BLOCK_SEP = re.compile(r"\n[ \t]*\n\s*")


@dataclass(frozen=True)
class Boilerplate:
    """Blocks (paragraphs: text between blank lines) that repeat across a corpus's
    documents are boilerplate: a copyright footer, a cookie notice, a "subscribe" box,
    the chrome an extractor did not know. A block is compared with its whitespace and
    case folded; it is boilerplate when it has at least `min_words` words (a label such
    as "Note" or "See also" stays with what it labels) and at least `min_docs` documents
    and at least `min_share` of the corpus's documents hold it. `min_share=0` turns it off."""

    min_share: float = 0.5
    min_docs: int = 3
    min_words: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.min_share <= 1:
            raise ValueError(f"boilerplate share {self.min_share}: use a number in [0, 1]")
        if self.min_docs < 2:
            raise ValueError(f"boilerplate documents {self.min_docs}: use at least 2")

    def __str__(self) -> str:
        return (f"a block of {self.min_words}+ words in at least {self.min_docs} documents "
                f"and {self.min_share:.0%} of them")

    @staticmethod
    def _key(block: str) -> str:
        return " ".join(block.split()).lower()

    def find(self, texts: Iterable[str]) -> frozenset[str]:
        """The folded blocks that repeat across `texts` by this rule."""
        if self.min_share == 0:
            return frozenset()
        counts: Counter[str] = Counter()
        docs = 0
        for text in texts:
            docs += 1
            counts.update({k for b in _BLOCK_SEP.split(text)
                           if (k := self._key(b)) and k.count(" ") + 1 >= self.min_words})
        need = max(self.min_docs, math.ceil(self.min_share * docs))
        return frozenset(k for k, c in counts.items() if c >= need)

    def strip(self, text: str, repeated: frozenset[str]) -> tuple[str, int]:
        """`text` without the blocks of `repeated` (the blank lines around them folded),
        and how many blocks went."""
        parts = _BLOCK_SEP.split(text)
        seps = _BLOCK_SEP.findall(text)
        kept: list[str] = []
        n = 0
        for i, block in enumerate(parts):
            if self._key(block) in repeated:
                n += 1
                continue
            if kept:
                kept.append(seps[i - 1] if i - 1 < len(seps) else "\n\n")
            kept.append(block)
        return "".join(kept), n


def reasons_count(rejected: Iterable[Rejected]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rejected:
        counts[r.reason] = counts.get(r.reason, 0) + 1
    return counts


def piece_rows(pieces: Iterable[Piece]) -> list[dict[str, Any]]:
    return [p.__dict__.copy() for p in pieces]
