"""Benchmark: documents read as a person reads them (issue #36), on real Sphinx HTML.

The corpus: 40 pages of the Python documentation Debian ships (python3.11-doc, installed
by scripts/setup.sh), evenly spaced over the sorted library/*.html, copied into a temp
folder and ingested as a data build does (datasets_prep.corpus.ingest: extraction,
normalisation, cross-document boilerplate, pieces of 1,024 tokens).

The reference is derived from the HTML without the extractor: what a browser shows of the
page once the Sphinx chrome is removed by its classes (div.related, div.sphinxsidebar,
div.footer, div.mobile-nav, <nav>, a.headerlink). Each text node belongs to its nearest
block ancestor (the CSS box it renders in); a block's text nodes are joined and its
whitespace folded (white-space: normal); `<pre>` is left out (code, not sentences). Blocks
are split into sentences after . ! ? and a space; sentences of at least 4 words count.

1. accepted: the share of the pages' rendered sentences that sandflow's own evidence
   check (datagen.questions.supported, the synth stage's test) accepts as evidence in one
   of the page's pieces. Goal >= 0.98 (pooled over the pages; the worst page is shown).
2. chrome: the share of the ingested text's characters (whitespace excluded) that are
   chrome: each text block of the chrome containers, counted where the ingested text holds
   it more often than the reference does (whitespace-insensitive, whole words; blocks
   without a letter or digit left out: the breadcrumb bar's "|" is also the separator of
   a table row's cells), plus "¶".
   Goal <= 0.005.
The floor in the same run: the extraction before #36 (selectolax's text with a line break
at every element; scripts, styles, the head, <nav> and <footer> dropped) measured alike.
Speed: pages per second of each extraction (absolute, no goal).

Run:  .venv/bin/python benchmarks/ingest.py [--pages 40] [--html-root DIR]
(no Docker; ~15 s). Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HTML_ROOT = "/usr/share/doc/python3.11/html"
CHROME = ("div.related", "div.sphinxsidebar", "div.footer", "div.mobile-nav", "nav")
NEVER_SHOWN = ("script", "style", "head", "noscript", "template", "svg")
BLOCK = frozenset(
    ["html", "body", "div", "section", "article", "main", "p", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li", "dl", "dt", "dd", "table", "thead", "tbody", "tfoot", "tr", "td", "th", "caption", "blockquote", "figure", "figcaption", "hr", "pre", "aside", "header", "footer", "nav", "form", "details", "summary", "address", "center"]
)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
WORD = re.compile(r"\w+")


def pages(root: str, n: int) -> list[Path]:
    allp = sorted(Path(root, "library").glob("*.html"))
    if not allp:
        raise SystemExit(f"no pages under {root}/library: install python3.11-doc (scripts/setup.sh)")
    step = max(1, len(allp) // n)
    return allp[::step][:n]


def block_texts(node) -> list[str]:
    """Each block's own text (nearest block ancestor of every text node), folded; <pre> out."""
    groups: dict[int, list[str]] = {}
    order: list[int] = []
    for t in node.traverse(include_text=True):
        if not t.is_text_node:
            continue
        p, owner, in_pre = t.parent, None, False
        while p is not None:
            if p.tag == "pre":
                in_pre = True
                break
            if owner is None and p.tag in BLOCK:
                owner = p
            p = p.parent
        if in_pre or owner is None:
            continue
        key = owner.mem_id
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(t.text_content or "")
    out = []
    for k in order:
        s = " ".join("".join(groups[k]).split())
        if s:
            out.append(s)
    return out


def reference(html: str) -> tuple[list[str], list[str], str]:
    """(rendered sentences, chrome blocks, the rendered main text) of a page."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(html)
    for sel in NEVER_SHOWN:
        for n in tree.css(sel):
            n.decompose()
    chrome: list[str] = []
    for sel in CHROME:
        for n in tree.css(sel):
            chrome += block_texts(n)
            n.decompose()
    for n in tree.css("a.headerlink"):
        n.decompose()
    body = tree.body
    blocks = block_texts(body) if body is not None else []
    pre = [p.text(deep=True) for p in (body.css("pre") if body is not None else [])]
    sentences = [s for b in blocks for s in SENTENCE_END.split(b) if len(WORD.findall(s)) >= 4]
    return sentences, chrome, "\n".join(blocks + pre)


def old_html_text(data: bytes) -> str:
    """The extraction before #36 (main at 2a63bff), kept here as the floor."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(data.decode("utf-8-sig"))
    for tag in ("script", "style", "noscript", "template", "svg", "head", "nav", "footer"):
        for node in tree.css(tag):
            node.decompose()
    root = tree.body or tree.root
    text = root.text(separator="\n", strip=True) if root is not None else ""
    return re.sub(r"\n{3,}", "\n\n", text)


def _pattern(segment: str) -> re.Pattern[str]:
    toks = segment.split()
    body = r"\s*".join(re.escape(t) for t in toks)
    left = r"(?<!\w)" if re.match(r"\w", toks[0]) else ""
    right = r"(?!\w)" if re.search(r"\w$", toks[-1]) else ""
    return re.compile(left + body + right)


def chrome_chars(text: str, chrome: list[str], ref: str) -> int:
    """Non-space characters of `text` that are chrome (see the module docstring)."""
    mask = bytearray(len(text))
    total = 0
    for seg in sorted(set(chrome), key=len, reverse=True):
        if not WORD.search(seg):  # "|" of the breadcrumb bar: the table rows' separator too
            continue
        pat = _pattern(seg)
        extra = max(0, sum(1 for _ in pat.finditer(text)) - sum(1 for _ in pat.finditer(ref)))
        for m in pat.finditer(text):
            if extra == 0:
                break
            if any(mask[m.start():m.end()]):
                continue
            mask[m.start():m.end()] = b"\x01" * (m.end() - m.start())
            total += len("".join(m.group(0).split()))
            extra -= 1
    return total + max(0, text.count("\u00b6") - ref.count("\u00b6"))


def measure(folder: Path, refs: dict[str, tuple[list[str], list[str], str]]) -> dict:
    from datagen.questions import supported
    from datasets_prep.corpus import ingest

    t0 = time.perf_counter()
    res = ingest(str(folder))
    seconds = time.perf_counter() - t0
    by_doc: dict[str, list[str]] = {}
    for p in res.pieces:
        by_doc.setdefault(p.source, []).append(p.text)
    accepted = total = chars = chrome = 0
    worst = (1.0, "")
    for name, (sentences, chrome_blocks, ref_text) in refs.items():
        pieces = by_doc.get(name, [])
        ok = sum(1 for s in sentences if any(supported("", s, t) is None for t in pieces))
        accepted += ok
        total += len(sentences)
        if sentences and ok / len(sentences) < worst[0]:
            worst = (ok / len(sentences), name)
        text = "\n".join(pieces)
        chars += len("".join(text.split()))
        chrome += chrome_chars(text, chrome_blocks, ref_text)
    lines = [ln for t in by_doc.values() for ln in "".join(t).splitlines() if ln.strip()]
    return {
        "accepted": round(accepted / max(1, total), 4), "sentences": total,
        "worst_page_accepted": round(worst[0], 4), "worst_page": worst[1],
        "chrome_share": round(chrome / max(1, chars), 4), "chars": chars,
        "short_line_share": round(sum(1 for ln in lines if len(ln.strip()) <= 3) / max(1, len(lines)), 4),
        "pages_per_s": round(len(refs) / seconds, 2), "documents": len(res.documents),
        "rejected": len(res.rejected), "boilerplate": getattr(res, "boilerplate", {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=40)
    ap.add_argument("--html-root", default=HTML_ROOT)
    args = ap.parse_args()

    import datasets_prep.corpus as corpus

    chosen = pages(args.html_root, args.pages)
    tmp = Path(tempfile.mkdtemp(prefix="sandflow-bench-ingest-"))
    try:
        refs = {}
        for p in chosen:
            shutil.copyfile(p, tmp / p.name)
            refs[p.name] = reference(p.read_text(encoding="utf-8"))
        new = measure(tmp, refs)
        current = corpus.html_text
        corpus.html_text = old_html_text  # the floor: the same ingest with the old extraction
        try:
            old = measure(tmp, refs)
        finally:
            corpus.html_text = current
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{len(chosen)} pages of {args.html_root}/library, {new['sentences']} rendered sentences")
    for label, m in (("sandflow", new), ("before #36 (floor)", old)):
        print(f"  {label:20s} accepted {m['accepted']:.2%} (worst page {m['worst_page_accepted']:.2%} "
              f"{m['worst_page']}), chrome {m['chrome_share']:.2%} of {m['chars']:,} chars, "
              f"lines <= 3 chars {m['short_line_share']:.1%}, {m['pages_per_s']} pages/s")
    for label, m in (("sandflow", new), ("floor", old)):
        print(f"  cross-document boilerplate removed ({label}): {m['boilerplate']}")
    out = {
        "benchmark": "ingest", "pages": len(chosen), "sentences": new["sentences"],
        "accepted_share": new["accepted"], "accepted_worst_page": new["worst_page_accepted"],
        "chrome_share": new["chrome_share"], "short_line_share": new["short_line_share"],
        "pages_per_s": new["pages_per_s"], "boilerplate": new["boilerplate"],
        "floor_accepted_share": old["accepted"], "floor_chrome_share": old["chrome_share"],
        "floor_short_line_share": old["short_line_share"], "floor_pages_per_s": old["pages_per_s"],
        "floor_boilerplate": old["boilerplate"],
        "accepted_goal": 0.98, "chrome_goal": 0.005,
        "pass": new["accepted"] >= 0.98 and new["chrome_share"] <= 0.005,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
