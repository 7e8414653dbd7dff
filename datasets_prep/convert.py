"""Any table of (context, question, answer[, choices]) -> sandbox tasks.

This is the paper's recipe for RL data from general-domain context: the context
goes into files under the input directory (split at section or paragraph
boundaries when long, so a model has to look for what it needs), and the prompt
carries the question and says where the documents are. It works on a user's own
corpus: the context may be a column of text, or a column of paths to documents.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from datasets_prep.paths import UnsafePathError, read_inside, show
from datasets_prep.task import (
    DOCUMENTS_DIR,
    Task,
    TaskValidationError,
    make_task,
)

DEFAULT_CHUNK_CHARS = 20_000
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

_HEADING = re.compile(
    r"^(#{1,6} .+|(?:ACT|Act|CHAPTER|Chapter|SECTION|Section|PART|Part|SCENE|Scene)\b.*|[A-Z][A-Z0-9 ,'\-:]{3,80})$"
)


class ColumnMapping(BaseModel):
    """Which source column plays which role. Only question and answer are required."""

    question: str = "question"
    answer: str = "answer"
    context: str | None = "context"
    context_path: str | None = Field(default=None, description="column of paths to document files")
    choices: str | None = None
    id: str | None = None
    domain: str | None = None
    qa_type: str | None = None
    title: str | None = None

    @classmethod
    def parse(cls, spec: str | None) -> ColumnMapping:
        """`role=column,role=column` as typed on the command line."""
        if not spec:
            return cls()
        fields: dict[str, str | None] = {}
        for part in spec.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"mapping entry {part!r} is not role=column (e.g. context=passage)")
            role, col = (x.strip() for x in part.split("=", 1))
            if role not in cls.model_fields:
                raise ValueError(
                    f"unknown mapping role {role!r}; roles: {', '.join(cls.model_fields)}"
                )
            fields[role] = col or None
        return cls.model_validate(fields)

    def check_columns(self, columns: Iterable[str]) -> None:
        cols = set(columns)
        required = [("question", self.question), ("answer", self.answer)]
        optional = [
            (r, getattr(self, r))
            for r in ("context_path", "choices", "id", "domain", "qa_type", "title")
            if getattr(self, r)
        ]
        missing = [f"{r} -> {c!r}" for r, c in required + optional if c not in cols]
        # The default `context` column is optional; a context column the user named is not.
        if self.context and self.context not in cols and not self.context_path and self.context != "context":
            missing.append(f"context -> {self.context!r}")
        if missing:
            raise TaskValidationError(
                f"missing column(s): {', '.join(missing)}; the table has: {', '.join(sorted(cols)) or '(none)'}. "
                "Map roles to columns with --mapping role=column,..."
            )


def split_document(text: str, max_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """Split long text into chunks of at most ~max_chars, preferring section headings,
    then blank lines (paragraphs), then line ends, then a hard cut. Joining the chunks
    gives back the text exactly."""
    if len(text) <= max_chars:
        return [text]
    blocks = _split_keep(text, _is_boundary_heading)
    out: list[str] = []
    cur = ""
    for block in blocks:
        for piece in _fit(block, max_chars):
            if cur and len(cur) + len(piece) > max_chars:
                out.append(cur)
                cur = ""
            cur += piece
    if cur:
        out.append(cur)
    return out


def _is_boundary_heading(line: str) -> bool:
    return bool(_HEADING.match(line.strip())) and len(line.strip()) < 100


def _split_keep(text: str, is_head: Any) -> list[str]:
    """Split before heading lines; concatenating the blocks restores the text."""
    blocks: list[str] = []
    cur: list[str] = []
    prev_blank = True
    for line in text.splitlines(keepends=True):
        if cur and prev_blank and is_head(line):
            blocks.append("".join(cur))
            cur = []
        cur.append(line)
        prev_blank = not line.strip()
    if cur:
        blocks.append("".join(cur))
    return blocks


def _fit(block: str, max_chars: int) -> list[str]:
    if len(block) <= max_chars:
        return [block]
    pieces = re.split(r"(?<=\n\n)", block)  # paragraph ends, separators kept
    if max(len(p) for p in pieces) > max_chars:
        pieces = [q for p in pieces for q in (p.splitlines(keepends=True) if len(p) > max_chars else [p])]
    out: list[str] = []
    for p in pieces:
        while len(p) > max_chars:  # one enormous line: hard cut
            out.append(p[:max_chars])
            p = p[max_chars:]
        out.append(p)
    return out


def slug(text: str, max_len: int = 40) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()
    return s[:max_len] or "document"


def context_files(
    context: str | Sequence[str], *, title: str | None = None, max_chars: int = DEFAULT_CHUNK_CHARS
) -> dict[str, str]:
    """Turn one or more context documents into files: `<name>.txt`, or
    `<name>_part01.txt`, ... when a document is split."""
    docs = [context] if isinstance(context, str) else list(context)
    files: dict[str, str] = {}
    for d, doc in enumerate(docs, start=1):
        base = slug(title) if title and len(docs) == 1 else (f"{slug(title)}_{d:02d}" if title else f"document_{d:02d}")
        parts = split_document(doc, max_chars)
        if len(parts) == 1:
            files[f"{base}.txt"] = parts[0]
        else:
            for i, part in enumerate(parts, start=1):
                files[f"{base}_part{i:02d}.txt"] = part
    return files


def documents_note(files: Mapping[str, Any], input_dir: str = DOCUMENTS_DIR) -> str:
    """The sentence telling the model where its documents are."""
    names = sorted(files)
    shown = ", ".join(names[:12]) + (f", ... ({len(names)} files)" if len(names) > 12 else "")
    total = sum(len(v) for v in files.values())
    return (
        f"The documents you need are in {input_dir}/ ({len(names)} file(s), about {total:,} characters): "
        f"{shown}. Read them there; they are not included in this message."
    )


def format_choices(choices: Any, where: str) -> list[str]:
    if isinstance(choices, str):
        text = choices.strip()
        if text.startswith("["):
            import json

            try:
                choices = json.loads(text)
            except ValueError:
                raise TaskValidationError(f"{where}: choices: not a JSON list") from None
        else:
            choices = [c for c in re.split(r"\s*\|\s*|\n", text) if c]
    if isinstance(choices, dict):
        choices = [choices[k] for k in sorted(choices)]
    if not isinstance(choices, list | tuple) or len(choices) < 2:
        raise TaskValidationError(f"{where}: choices: need a list of at least 2 options")
    if len(choices) > len(LETTERS):
        raise TaskValidationError(f"{where}: choices: {len(choices)} options; at most 26")
    return [str(c) for c in choices]


def build_prompt(question: str, choices: list[str] | None, note: str | None) -> str:
    parts = [question.strip()]
    if choices:
        parts.append("\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices)))
        parts.append("Answer with the letter(s) of the correct option(s).")
    if note:
        parts.append(note)
    return "\n\n".join(parts)


def _read_document(path_value: Any, base_dir: Path | None, where: str, column: str) -> str:
    """A context_path document, strictly inside the table's folder (datasets_prep.paths):
    `..`, absolute paths, /proc/..., and symlinks that leave the folder are refused."""
    field = f"context_path (column {column!r})"
    if base_dir is None:
        raise TaskValidationError(
            f"{where}: {field}: {str(path_value)!r}: paths are read relative to the table's "
            "folder, and this source has none (a hub dataset, or rows given in Python without "
            "base_dir); put the text in a context column instead"
        )
    if not isinstance(path_value, str):
        raise TaskValidationError(f"{where}: {field}: expected a path, got {type(path_value).__name__}")
    try:
        data = read_inside(base_dir, path_value)
    except UnsafePathError as e:
        raise TaskValidationError(f"{where}: {field}: {e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskValidationError(
            f"{where}: {field}: {show(path_value)} is not valid UTF-8 "
            f"(byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def convert_rows(
    rows: Iterable[dict[str, Any]],
    mapping: ColumnMapping | None = None,
    *,
    domain: str = "general",
    qa_type: str | None = None,
    id_prefix: str = "task",
    max_chars: int = DEFAULT_CHUNK_CHARS,
    input_dir: str = DOCUMENTS_DIR,
    base_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Task]:
    """Rows of a (context, question, answer[, choices]) table -> tasks.

    Ids come from the id column, or from a hash of question+answer+context, so the
    same table always gives the same ids. `progress(done, total)` is called as rows finish."""
    m = mapping or ColumnMapping()
    rows = list(rows)
    if rows:
        m.check_columns(rows[0].keys())
    tasks = []
    for i, row in enumerate(rows):
        if progress is not None and i % 50 == 0:
            progress(i, len(rows))
        where = f"row {i}"
        question = row.get(m.question)
        answer = row.get(m.answer)
        if isinstance(question, bytes) or isinstance(answer, bytes):
            raise TaskValidationError(f"{where}: question/answer: binary value, expected text")
        if question is None or not str(question).strip():
            raise TaskValidationError(f"{where}: {m.question} (question): empty")
        if answer is None or (isinstance(answer, str | list) and not answer) or (
            isinstance(answer, str) and not answer.strip()
        ):
            raise TaskValidationError(f"{where}: {m.answer} (answer): empty")
        context: Any = row.get(m.context) if m.context else None
        if m.context_path and row.get(m.context_path):
            context = _read_document(row[m.context_path], base_dir, where, m.context_path)
        if isinstance(context, bytes):
            raise TaskValidationError(f"{where}: {m.context} (context): binary value, expected text")
        title = str(row[m.title]) if m.title and row.get(m.title) else None
        files: dict[str, str] = {}
        if context:
            files = context_files(context if isinstance(context, str | list) else str(context), title=title, max_chars=max_chars)
        choices = format_choices(row[m.choices], where) if m.choices and row.get(m.choices) is not None else None
        row_type = str(row[m.qa_type]) if m.qa_type and row.get(m.qa_type) else qa_type
        gt: Any = answer
        if choices:
            try:
                letters = _answer_letters(answer, choices)
            except TaskValidationError as e:
                raise TaskValidationError(f"{where}: {m.answer} (answer): {e}") from None
            row_type = row_type or ("multi_choice" if len(letters) > 1 else "single_choice")
            gt = ",".join(letters)
        note = documents_note(files, input_dir) if files else None
        rid = str(row[m.id]) if m.id and row.get(m.id) is not None else None
        if rid is None:
            h = hashlib.sha256(repr((question, answer, context)).encode("utf-8", "replace")).hexdigest()[:12]
            rid = f"{id_prefix}-{h}"
        meta: dict[str, Any] = {"question": str(question), "source_row": i}
        if note:
            meta["documents_note"] = note
            meta["input_dir"] = input_dir
        if choices:
            meta["choices"] = choices
        if title:
            meta["title"] = title
        tasks.append(
            make_task(
                {
                    "id": rid,
                    "domain": str(row[m.domain]) if m.domain and row.get(m.domain) else domain,
                    "problem_statement": build_prompt(str(question), choices, note),
                    "ground_truth": gt,
                    "input_files": files,
                    "qa_type": row_type or "open",
                    "metadata": meta,
                },
                f"{where} (id {rid!r})",
            )
        )
    return tasks


def _answer_letters(answer: Any, choices: list[str]) -> list[str]:
    """An answer given as letters ('B', 'A,C'), indices (1, [0, 2]) or option text."""
    items = answer if isinstance(answer, list | tuple) else re.split(r"\s*[,;]\s*", str(answer).strip())
    letters = []
    for a in items:
        if isinstance(a, int) and not isinstance(a, bool):
            if not 0 <= a < len(choices):
                raise TaskValidationError(f"answer index {a} is outside the {len(choices)} choices")
            letters.append(LETTERS[a])
            continue
        s = str(a).strip()
        if len(s) == 1 and s.upper() in LETTERS[: len(choices)]:
            letters.append(s.upper())
        elif s in choices:
            letters.append(LETTERS[choices.index(s)])
        else:
            raise TaskValidationError(f"answer {s!r} is neither an option letter nor one of the choices")
    return sorted(set(letters))
