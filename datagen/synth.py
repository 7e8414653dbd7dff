"""Synthesize: pieces of text -> checked questions of the three LIS-RL types.

One chat call per question slot (`n` slots per piece, the types taken in turn), to any
OpenAI-compatible endpoint through the model client every episode uses (retries,
Retry-After, the key kept out of errors). Each call asks for the question's JSON schema
through the endpoint's structured output, so a small model still returns parseable JSON:

    json_schema   response_format {"type": "json_schema", ...}: OpenAI, vLLM, llama.cpp's server
    json_object   response_format {"type": "json_object", "schema": ...}: llama-cpp-python
    guided_json   vLLM's guided decoding extra field
    none          plain text (the checks still apply)
    auto          json_schema, for an endpoint given by URL and for the embedded model
                  (its server turns the schema into a llama.cpp grammar, parsed before
                  sampling: tasks/local_chat.py; docs/data.md)

The document goes to the generator as data: between <document> tags, any tag in the
text that would close them neutralised, under a system message that says so; a
document that tries to instruct the generator can at most make it write a question
the checks drop (datagen.questions: the answer must be supported by the document).

Re-running on the same pieces reuses what was done: every reply is kept in a cache
keyed by a hash of the request (model, messages, schema, sampling, slot), so only
slots without a cached reply call the model. Model errors are not cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from datagen.budget import TERMINATION as BUDGET_EXHAUSTED
from datagen.budget import BuildBudget
from datagen.questions import TYPES, Invalid, Question, check, json_schema
from datasets_prep.convert import build_prompt, context_files, documents_note, slug
from datasets_prep.corpus import Piece
from datasets_prep.rows import LIS_RL_DEFAULT_DOMAIN
from datasets_prep.task import DOCUMENTS_DIR, Task, make_task
from tasks.model import ModelClient, ModelConfig, ModelError
from warehouse.layout import fsync_dir

STRUCTURED = ("json_schema", "json_object", "guided_json", "none")


def resolve_structured(style: str, embedded: bool) -> str:
    """`auto` -> the style for this endpoint (see the module doc); others unchanged.
    (`embedded` is kept for callers: every endpoint gets json_schema today.)"""
    if style == "auto":
        return "json_schema"
    return style
DEFAULT_TEMPLATE = "questions.v1.yaml"
_CLOSE_TAG = "</document"


class SynthConfigError(ValueError):
    """A synthesis parameter or template is unusable (one sentence, before any call)."""


@dataclass(frozen=True)
class Template:
    """A versioned prompt template file: `version` is its name plus a hash of its bytes."""

    name: str
    version: str
    system: str
    user: str
    types: dict[str, str]

    @classmethod
    def load(cls, path: str | Path | None = None) -> Template:
        if path is None:
            data = resources.files("datagen.templates").joinpath(DEFAULT_TEMPLATE).read_bytes()
            where = DEFAULT_TEMPLATE
        else:
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                raise SynthConfigError(f"prompt template {str(path)!r}: {e.strerror}") from None
            where = str(path)
        try:
            doc = yaml.safe_load(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise SynthConfigError(
                f"prompt template {where!r} is not UTF-8 (byte {data[e.start]:#04x} at offset {e.start})"
            ) from None
        except yaml.YAMLError as e:
            raise SynthConfigError(f"prompt template {where!r} is not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(doc, dict):
            raise SynthConfigError(f"prompt template {where!r}: expected a mapping with "
                                   f"name, system, user and types, got a {type(doc).__name__}")
        missing = [k for k in ("name", "system", "user", "types") if not doc.get(k)]
        if missing:
            raise SynthConfigError(f"prompt template {where!r}: missing {', '.join(missing)}")
        not_text = [k for k in ("name", "system", "user") if not isinstance(doc[k], (str, int, float))]
        if not_text:
            raise SynthConfigError(f"prompt template {where!r}: {not_text[0]!r} must be text, "
                                   f"not a {type(doc[not_text[0]]).__name__}")
        types = doc["types"]
        if not isinstance(types, dict) or any(t not in types for t in TYPES):
            raise SynthConfigError(f"prompt template {where!r}: 'types' must give {', '.join(TYPES)}")
        bad_type = next((t for t in TYPES if not isinstance(types[t], str) or not types[t].strip()), None)
        if bad_type:
            raise SynthConfigError(f"prompt template {where!r}: types.{bad_type} must be non-empty text")
        if "{{document}}" not in str(doc["user"]):
            raise SynthConfigError(f"prompt template {where!r}: 'user' must contain {{{{document}}}}")
        digest = hashlib.sha256(data).hexdigest()[:8]
        name = str(doc["name"])
        return cls(name, f"{name}@{digest}", str(doc["system"]), str(doc["user"]),
                   {k: str(v) for k, v in types.items()})

    def messages(self, qtype: str, document: str) -> list[dict[str, str]]:
        """The chat request of one slot. The document cannot close its own delimiter."""
        safe = document.replace(_CLOSE_TAG, "<\u2060/document").replace("<document", "<\u2060document")
        user = self.user.replace("{{type_instructions}}", self.types[qtype]).replace("{{document}}", safe)
        return [{"role": "system", "content": self.system.strip()}, {"role": "user", "content": user}]


def _yaml_problem(e: Exception) -> str:
    """A YAML error in one line: what is wrong and where (PyYAML's own text spans lines
    and names "<unicode string>", not the file)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


def structured_body(style: str, qtype: str) -> dict[str, Any]:
    """The extra request fields asking for `qtype`'s JSON schema in `style`."""
    schema = json_schema(qtype)
    if style == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": qtype, "schema": schema, "strict": True}}}
    if style == "json_object":
        return {"response_format": {"type": "json_object", "schema": schema}}
    if style == "guided_json":
        return {"guided_json": schema}
    if style == "none":
        return {}
    raise SynthConfigError(f"structured output {style!r}: use one of {', '.join(STRUCTURED)}")


@dataclass
class Slot:
    piece: Piece
    index: int
    qtype: str

    @property
    def slot_id(self) -> str:
        return f"{self.piece.piece_id}#{self.index}"


def plan_slots(pieces: Sequence[Piece], n: int, types: Sequence[str]) -> list[Slot]:
    if n < 1:
        raise SynthConfigError(f"questions per piece {n}: use at least 1")
    bad = [t for t in types if t not in TYPES]
    if bad or not types:
        raise SynthConfigError(f"question types {', '.join(bad) or '(none)'}: use {', '.join(TYPES)}")
    return [Slot(p, i, types[i % len(types)]) for p in pieces for i in range(n)]


SYNC_EVERY_S = 1.0  # the reply cache's fsync interval (a write is in the kernel at once)


class ReplyCache:
    """Replies by request hash, in a JSONL file (appended; the last line of a key wins).

    Each reply is paid for, so `put` hands it to the kernel (one write, flushed) before it
    returns: the slot that asked counts it done only once a kill -9, the OOM killer or a
    crash of Python can no longer lose it (the page cache outlives the process). A buffer
    of 16 replies lost 12-13 paid replies to a kill -9 during synthesis, each asked (and
    paid) again on the resume (issue #37). Against an OS crash or power cut the file is
    fsynced by the first put SYNC_EVERY_S or more after the last sync (outside the lock)
    and at close, so such a crash costs the replies since the last sync (the kernel's own
    writeback bounds them too), asked again on the resume. An fsync per reply cost ~4 ms
    each here, 2.6x the stage's time against an instant endpoint (benchmarks/data_build.py)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, Any]] = {}
        self._file: Any = None
        self._synced_at = time.monotonic()
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash (only a reply not yet put): asked again
                if isinstance(row, dict) and isinstance(row.get("key"), str):
                    self._data[row["key"]] = row

    def get(self, key: str) -> dict[str, Any] | None:
        return self._data.get(key)

    def rows(self) -> list[dict[str, Any]]:
        """Every reply held (a data build's budget counts them: datagen.budget)."""
        with self._lock:
            return list(self._data.values())

    def put(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, ensure_ascii=False) + "\n"
        fd = None
        with self._lock:
            self._data[row["key"]] = row
            if self.path is not None:
                if self._file is None:  # one handle for the whole stage, not an open per reply
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    new = not self.path.exists()
                    self._file = self.path.open("a", encoding="utf-8")
                    if new:  # the file's name durable too, not only its bytes
                        fsync_dir(self.path.parent)
                    elif not _ends_a_line(self.path):  # a line cut by a crash: end it, or
                        self._file.write("\n")  # the next reply would be glued to it and lost
                self._file.write(line)
                self._file.flush()  # in the kernel: a kill -9 of this process loses nothing
                now = time.monotonic()
                if now - self._synced_at >= SYNC_EVERY_S:
                    self._synced_at = now
                    fd = os.dup(self._file.fileno())  # fsync outside the lock, on a handle of its own
        if fd is not None:
            try:
                os.fsync(fd)  # on the disk: an OS crash loses at most the last second's replies
            finally:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


@dataclass
class SlotOutcome:
    slot_id: str
    piece_id: str
    qtype: str
    kept: bool
    reason: str | None = None
    detail: str | None = None
    question: Question | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False


@dataclass
class SynthResult:
    outcomes: list[SlotOutcome] = field(default_factory=list)
    model: str = ""
    template_version: str = ""
    calls: int = 0
    cache_hits: int = 0
    seconds: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(o.prompt_tokens for o in self.outcomes)

    @property
    def completion_tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outcomes)


def request_key(cfg: ModelConfig, template: Template, qtype: str, structured: str, slot: int,
                text: str) -> str:
    """The reply cache's key: everything the request is made of (the messages are a
    function of the template version, the type and the piece's text; the structured-output
    body of the style and the type), hashed without serialising the messages again."""
    h = hashlib.sha256("\0".join(map(str, (
        cfg.model, template.version, qtype, structured, slot, cfg.temperature, cfg.top_p, cfg.max_tokens,
    ))).encode())
    h.update(b"\0")
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def synthesize(
    pieces: Sequence[Piece],
    cfg: ModelConfig,
    *,
    n: int = 3,
    types: Sequence[str] = TYPES,
    template: Template | None = None,
    structured: str = "json_schema",
    concurrency: int = 4,
    cache: ReplyCache | None = None,
    progress: Callable[[SlotOutcome], None] | None = None,
    budget: BuildBudget | None = None,
) -> SynthResult:
    """Every slot of every piece -> a kept question or a dropped slot with its reason.
    With a `budget` (datagen.budget), once it is spent no slot asks the model: those are
    dropped as `budget_exhausted` (not cached: a resume asks them)."""
    template = template or Template.load()
    if structured not in STRUCTURED:
        raise SynthConfigError(f"structured output {structured!r}: use one of {', '.join(STRUCTURED)}")
    if concurrency < 1:
        raise SynthConfigError(f"concurrency {concurrency}: use at least 1")
    slots = plan_slots(pieces, n, types)
    cache = cache or ReplyCache(None)
    extras = {t: structured_body(structured, t) for t in TYPES}
    # one client (one connection pool) for every type: the schema goes per call. A client
    # per type kept up to three pools of `concurrency` connections each to one endpoint,
    # and cost ~10% more CPU per call than one pool (benchmarks/data_build.py)
    client = ModelClient(cfg)
    result = SynthResult(model=cfg.model, template_version=template.version)
    lock = threading.Lock()

    def one(slot: Slot) -> SlotOutcome:
        key = request_key(cfg, template, slot.qtype, structured, slot.index, slot.piece.text)
        row = cache.get(key)
        cached = row is not None
        spent = budget.exceeded() if row is None and budget is not None else None
        if spent is not None:
            row = None
            out = SlotOutcome(slot.slot_id, slot.piece.piece_id, slot.qtype, False,
                              BUDGET_EXHAUSTED, spent)
        elif row is None:
            try:
                reply = client.complete(template.messages(slot.qtype, slot.piece.text),
                                        extra_body=extras[slot.qtype])
            except ModelError as e:
                row = None
                out = SlotOutcome(slot.slot_id, slot.piece.piece_id, slot.qtype, False,
                                  "model_error", str(e)[:500])
            else:
                row = {"key": key, "content": reply.content,
                       "prompt_tokens": reply.usage.prompt_tokens or 0,
                       "completion_tokens": reply.usage.completion_tokens or 0,
                       "cached_tokens": reply.usage.cached_tokens or 0,
                       "reasoning_tokens": reply.usage.reasoning_tokens or 0}
                cache.put(row)
                if budget is not None:
                    budget.add_rows([row])
        if row is not None:
            out = _judge(slot, row, cached)
        with lock:
            result.calls += 0 if cached or spent is not None else 1
            result.cache_hits += 1 if cached else 0
        if progress is not None:
            progress(out)
        return out

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            result.outcomes = list(pool.map(one, slots))
    finally:
        client.close()
        cache.close()
    result.seconds = time.perf_counter() - t0
    return result


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _judge(slot: Slot, row: dict[str, Any], cached: bool) -> SlotOutcome:
    # the tokens the reply cost when it was made (a cached reply costs nothing now: `cached`)
    pt, ct = int(row.get("prompt_tokens") or 0), int(row.get("completion_tokens") or 0)
    try:
        q = check(slot.qtype, row.get("content"), slot.piece.text)
    except Invalid as e:
        return SlotOutcome(slot.slot_id, slot.piece.piece_id, slot.qtype, False, e.reason,
                           e.detail, prompt_tokens=pt, completion_tokens=ct, cached=cached)
    return SlotOutcome(slot.slot_id, slot.piece.piece_id, slot.qtype, True, question=q,
                       prompt_tokens=pt, completion_tokens=ct, cached=cached)


def question_task(
    q: Question, piece: Piece, *, model: str, template_version: str, build_id: str,
    domain: str = LIS_RL_DEFAULT_DOMAIN, input_dir: str = DOCUMENTS_DIR,
) -> Task:
    """A checked question as a sandbox task: the piece as a file, the question in the prompt,
    provenance (document, span, generator, prompt version) in the metadata."""
    title = slug(Path(piece.source.split("#")[0]).stem or "document")
    files = context_files(piece.text, title=title)
    note = documents_note(files, input_dir)
    options = list(q.options) or None
    tid = q.key(piece.piece_id)
    meta: dict[str, Any] = {
        "question": q.question,
        "documents_note": note,
        "input_dir": input_dir,
        "evidence": q.evidence,
        "question_type": q.qtype,
        "provenance": {
            "build_id": build_id,
            "doc_id": piece.doc_id,
            "piece_id": piece.piece_id,
            "source": piece.source,
            "span": [piece.start, piece.end],
            "generator_model": model,
            "prompt_version": template_version,
        },
    }
    if options:
        meta["choices"] = options
    return make_task(
        {
            "id": tid,
            "domain": domain,
            "problem_statement": build_prompt(q.question, options, note),
            "ground_truth": q.answer.replace(" ", "") if options else q.answer,
            "input_files": files,
            "qa_type": q.qa_type,
            "metadata": meta,
        },
        f"question {tid!r} (piece {piece.piece_id})",
    )


def pieces_by_id(pieces: Iterable[Piece]) -> dict[str, Piece]:
    return {p.piece_id: p for p in pieces}
