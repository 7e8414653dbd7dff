"""The task: one question, its documents, and how its answer is checked.

Rows in llm-in-sandbox's format (id, domain, problem_statement, ground_truth,
input_files, qa_type) load as they are, so users can bring their existing data.

A `Task` validates itself (safe file names, bounded sizes of files *and* text,
valid UTF-8 everywhere, no secret from the environment, a ground truth its verifier
can use) so that a bad row fails here, with its id and field named, and never deep
inside a sandbox, a Parquet writer or a reward. The bounds live in
`datasets_prep.limits`. A `TaskSet` is an ordered, id-unique list of tasks identified by a
content hash: the same source and seed give the same hash, so runs can say
exactly which data they used.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import PurePosixPath
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from datasets_prep import limits as L
from datasets_prep.limits import human_bytes as human_bytes  # re-exported (cli, callers)
from datasets_prep.paths import name_problem
from datasets_prep.verifiers.base import VerifierError

# Where the episode runner places `input_files` inside the sandbox. Prompts built
# here name this directory; a task may override it with metadata["input_dir"].
DOCUMENTS_DIR = "/testbed/documents"

# Size bounds: datasets_prep.limits (one place, env-configurable). Names and labels:
MAX_NAME_CHARS = 255  # one component of an input file name
MAX_LABEL_CHARS = 200  # id, domain, qa_type, verifier
MAX_NESTING = 64  # levels of lists/dicts in ground_truth and metadata

KNOWN_QA_TYPES = (
    "math",  # a mathematical answer: checked by math-verify
    "numeric",  # a number, optionally with a unit and a tolerance
    "single_choice",  # one option letter
    "multi_choice",  # a set of option letters (F1)
    "exact",  # a short string, compared after normalisation
    "open",  # free text: math check first, then ROUGE-L (as the paper)
    "instruction",  # instruction following (IFBench checkers)
)


class TaskValidationError(ValueError):
    """A task or task set failed validation; the message names the row and field."""


class GroundTruthError(TaskValidationError, VerifierError):
    """A task's ground truth no verifier can use, found when the task is built (it is
    both: a validation error of the row, and the VerifierError scoring would raise)."""


def check_file_name(name: str) -> str:
    """Accept only relative POSIX paths that stay inside the input directory, in UTF-8,
    without control or bidirectional-override characters."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("file name is empty")
    if "\x00" in name:
        raise ValueError(f"file name {name!r} contains a NUL byte")
    bad = name_problem(name)
    if bad and not bad.startswith(("is an absolute", "contains '..'")):  # said better below
        raise ValueError(f"file name {name!r} {bad}")
    if "\\" in name:
        raise ValueError(f"file name {name!r} contains a backslash; use '/' between folders")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise ValueError(f"file name {name!r} is an absolute path; give a path relative to the input directory")
    parts = PurePosixPath(name).parts
    if any(p == ".." for p in parts):
        raise ValueError(f"file name {name!r} contains '..' and could escape the input directory")
    if name.endswith("/"):
        raise ValueError(f"file name {name!r} names a directory, not a file")
    # '.', './', 'a/./b', 'a//b': PurePosixPath folds these away, so '.' would name the
    # input directory itself (placing it fails in every episode: "Is a directory").
    if any(p in ("", ".") for p in name.split("/")):
        raise ValueError(
            f"file name {name!r} has an empty or '.' part, so it does not name one file in the "
            "input directory; give a plain relative path such as 'notes.txt' or 'data/notes.txt'"
        )
    if any(len(p) > MAX_NAME_CHARS for p in parts):
        raise ValueError(f"file name {name!r} has a component longer than {MAX_NAME_CHARS} characters")
    return name


def check_file_tree(names: Iterable[str]) -> None:
    """Names that can all be placed: none is both a file and the folder of another
    (`{"a": ..., "a/b": ...}` fails in every sandbox). ValueError naming both paths."""
    files = set(names)
    for name in sorted(files):
        parts = name.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in files:
                raise ValueError(
                    f"input file {folder!r} is also the folder of input file {name!r}: a path "
                    "cannot be both a file and a folder, so rename one of them"
                )


def content_size(content: str | bytes) -> int:
    """Bytes a file will take in the sandbox (UTF-8 for text)."""
    if isinstance(content, bytes) or content.isascii():  # isascii is O(1) in CPython
        return len(content)
    if len(content) > L.LIMITS.max_task_bytes:  # utf-8 takes at least one byte per character
        return len(content)
    return len(content.encode("utf-8", "surrogatepass"))


def text_size(text: str, field: str) -> int:
    """UTF-8 size of one text field, refused over `max_text_bytes` (checked on the length
    first, so a 50 MB statement is refused without being encoded) or when not UTF-8."""
    limit = L.LIMITS.max_text_bytes
    if len(text) > limit:  # at least one byte per character
        raise ValueError(L.over_limit("the text", len(text), "max_text_bytes", "per text field"))
    if text.isascii():
        return len(text)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid UTF-8 text (a lone surrogate {text[e.start]!r} at offset {e.start}; "
            "the source held undecodable bytes or a broken \\u escape)"
        ) from None
    if size > limit:
        raise ValueError(L.over_limit("the text", size, "max_text_bytes", "per text field"))
    return size


def structured_size(value: Any, field: str) -> int:
    """About the JSON size of a ground truth or metadata value, refused over
    `max_text_bytes`, when nested deeper than MAX_NESTING, or when a string or key in it
    is not UTF-8 (Parquet and the records would fail later without naming the row)."""
    limit = L.LIMITS.max_text_bytes
    size = 0
    stack: list[tuple[Any, int, str]] = [(value, 0, field)]
    while stack:
        v, depth, where = stack.pop()
        if depth > MAX_NESTING:
            raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep")
        try:
            if isinstance(v, str):
                size += text_size(v, field) + 2
            elif isinstance(v, bytes):
                size += len(v)
            elif isinstance(v, Mapping):
                size += 2
                for k, x in v.items():
                    key = str(k)
                    try:
                        size += text_size(key, field) + 4
                    except ValueError as e:
                        raise ValueError(f"a key of {where}: {e}") from None
                    stack.append((x, depth + 1, f"{where}[{key!r}]"))
            elif isinstance(v, list | tuple | set | frozenset):
                size += 2 + len(v)
                stack.extend((x, depth + 1, f"{where}[{i}]") for i, x in enumerate(v))
            else:
                size += 8
        except ValueError as e:
            if where == field or str(e).startswith(("the text", "a key of")):
                raise
            raise ValueError(f"{where}: {e}") from None
        if size > limit:
            raise ValueError(L.over_limit("the value", size, "max_text_bytes", "per text field"))
    return size


def iter_strings(value: Any) -> Iterator[str | bytes]:
    """Every string (and key) inside a JSON-like value, without recursion."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str | bytes):
            yield v
        elif isinstance(v, Mapping):
            for k, x in v.items():
                yield str(k)
                stack.append(x)
        elif isinstance(v, list | tuple | set | frozenset):
            stack.extend(v)


class Task(BaseModel):
    """One problem for a model, in the sandbox or in plain LLM mode."""

    id: str
    domain: str
    problem_statement: str
    ground_truth: Any = None
    input_files: dict[str, str | bytes] = Field(default_factory=dict)
    qa_type: str | None = None
    verifier: str = "auto"
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id", "domain", "problem_statement")
    @classmethod
    def _non_empty(cls, v: str, info: Any) -> str:
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"{info.field_name} is empty")
        text_size(v, info.field_name)  # the length first: a 50 MB statement is not encoded
        return v

    @field_validator("id", "domain", "qa_type", "verifier")
    @classmethod
    def _label(cls, v: str | None, info: Any) -> str | None:
        if v is None:
            return v
        if len(v) > MAX_LABEL_CHARS:
            raise ValueError(f"{info.field_name} is {len(v)} characters long; at most {MAX_LABEL_CHARS} allowed")
        if any(ord(c) < 32 or ord(c) == 127 for c in v):
            raise ValueError(f"{info.field_name} contains a control character")
        text_size(v, info.field_name)
        return v

    @field_validator("ground_truth", "metadata")
    @classmethod
    def _structured(cls, v: Any, info: Any) -> Any:
        structured_size(v, info.field_name)
        return v

    @field_validator("input_files")
    @classmethod
    def _files(cls, files: dict[str, str | bytes]) -> dict[str, str | bytes]:
        lim = L.LIMITS
        if len(files) > lim.max_files_per_task:
            raise ValueError(
                f"{len(files)} input files; at most {lim.max_files_per_task} allowed "
                f"({L.env_name('max_files_per_task')})"
            )
        total = 0
        for name, content in files.items():
            check_file_name(name)
            # bytes: their length; text longer than the limit in characters is too big already
            if isinstance(content, bytes) or content.isascii() or len(content) > lim.max_file_bytes:
                size = len(content)
            else:  # one encode both sizes the text and proves it is valid UTF-8
                try:
                    size = len(content.encode("utf-8"))
                except UnicodeEncodeError as e:
                    raise ValueError(
                        f"input file {name!r} is not valid UTF-8 text (bad character at offset {e.start})"
                    ) from None
            if size > lim.max_file_bytes:
                raise ValueError(L.over_limit(f"input file {name!r}", size, "max_file_bytes", "per file"))
            total += size
        if total > lim.max_task_bytes:
            raise ValueError(L.over_limit("input files total", total, "max_task_bytes", "per task"))
        check_file_tree(files)
        return files

    @model_validator(mode="after")
    def _whole_task(self, info: ValidationInfo) -> Task:
        """Checks over several fields. `context={"adhoc": True}` (a `sandflow run` query,
        or re-checking a task before it enters a sandbox) skips the ground-truth checks."""
        adhoc = bool(info.context and info.context.get("adhoc"))
        if not adhoc and self.qa_type != "instruction" and _is_empty(self.ground_truth):
            raise ValueError("ground_truth is empty")
        total = (
            self.input_bytes
            + content_size(self.problem_statement)
            + structured_size(self.ground_truth, "ground_truth")
            + structured_size(self.metadata, "metadata")
        )
        if total > L.LIMITS.max_task_bytes:
            raise ValueError(L.over_limit("the task (files and text)", total, "max_task_bytes", "per task"))
        secret = find_secret_in_task(self)
        if secret is not None:
            where, name = secret
            raise ValueError(
                f"{where}: holds the value of the environment variable {name}; a secret must never "
                "go into a task (it would reach the sandbox and the records). Remove it from the "
                f"data, or unset {name} if that value is not secret"
            )
        # An instruction task may come without its checker spec (run for trajectories only);
        # scoring it raises VerifierError. Every other ground truth must suit its verifier.
        if not adhoc and not (self.qa_type == "instruction" and _is_empty(self.ground_truth)):
            from datasets_prep.verifiers import check_ground_truth

            check_ground_truth(self)  # VerifierError: unusable by the verifier scoring would use
        return self

    # --- derived -----------------------------------------------------------------
    @property
    def input_dir(self) -> str:
        return str(self.metadata.get("input_dir") or DOCUMENTS_DIR)

    def statement(self, mode: str = "sandbox") -> str:
        """The prompt for a mode. In "llm" mode (documents inlined by the caller) the
        sentence saying where the files are in the sandbox is left out."""
        note = self.metadata.get("documents_note")
        if mode == "llm" and isinstance(note, str) and note:
            return self.problem_statement.replace(note, "").strip()
        return self.problem_statement

    @property
    def input_bytes(self) -> int:
        return sum(content_size(c) for c in self.input_files.values())

    def canonical(self) -> dict[str, Any]:
        """A JSON-safe dict with a stable key order (bytes as base64)."""
        return {
            "id": self.id,
            "domain": self.domain,
            "problem_statement": self.problem_statement,
            "ground_truth": self.ground_truth,
            "input_files": {
                k: (encode_bytes(v) if isinstance(v, bytes) else v)
                for k, v in sorted(self.input_files.items())
            },
            "qa_type": self.qa_type,
            "verifier": self.verifier,
            "metadata": self.metadata,
        }

    @property
    def content_hash(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def _is_empty(v: Any) -> bool:
    if v is None:
        return True
    if isinstance(v, str):
        return not v.strip()
    if isinstance(v, list | dict | tuple | set):
        return len(v) == 0
    return False


def _env_secrets() -> dict[str, str]:
    """The secret values of the environment, by variable name.

    datasets_prep.secrets is the one definition of "secret": the warehouse scrubs the
    records with it too (it sits in the lowest layer so both can use it)."""
    from datasets_prep.secrets import secret_env_values

    return secret_env_values()


def find_secret_in_task(task: Task, secrets: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(field, variable) when a secret value of the environment occurs anywhere in the
    task's content — statement, files, ground truth, metadata — else None."""
    from datasets_prep.secrets import find_secret

    secrets = _env_secrets() if secrets is None else secrets
    if not secrets:
        return None
    checks: list[tuple[str, Any]] = [("problem_statement", task.problem_statement)]
    checks += [(f, getattr(task, f)) for f in ("id", "domain", "qa_type", "verifier")]
    checks += [(f"input_files[{name!r}]", content) for name, content in task.input_files.items()]
    checks += [(f"input_files[{name!r}] (its name)", name) for name in task.input_files]
    checks += [("ground_truth", task.ground_truth), ("metadata", task.metadata)]
    for where, value in checks:
        for text in iter_strings(value):
            name = find_secret(text, secrets)
            if name is not None:
                return where, name
    return None


def check_runnable(task: Task) -> None:
    """Re-check a task right before it goes into a sandbox or a record, whoever built it
    (`Task.model_construct` skips validation): names, sizes, UTF-8, secrets. Raises
    TaskValidationError naming the task and the field."""
    make_task(
        {k: getattr(task, k) for k in Task.model_fields}, f"task {task.id!r}", adhoc=True
    )


def check_scorable(task: Task, verifier: str | None = None) -> str:
    """`check_ground_truth`, and refuse a task with no ground truth at all (an instruction
    task without its checker spec, an ad-hoc query): VerifierError naming the task. For
    the places a task set leaves for another tool that expects rewards (a trainer's
    environment package, a Harbor task suite). Returns the verifier's name."""
    from datasets_prep.verifiers import check_ground_truth, choose

    name = str(verifier) if verifier not in (None, "", "auto") else choose(task)
    if _is_empty(task.ground_truth):
        raise VerifierError(
            f"task {task.id!r} has no ground truth, so its verifier ({name}) cannot score "
            "it: a task set without a verifier's ground truth cannot give rewards"
        )
    try:
        return check_ground_truth(task, verifier)
    except VerifierError as exc:
        raise VerifierError(f"task {task.id!r}: {exc}") from None


def encode_bytes(b: bytes) -> dict[str, str]:
    return {"__bytes_b64__": base64.b64encode(b).decode("ascii")}


def decode_maybe_bytes(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"__bytes_b64__"}:
        return base64.b64decode(v["__bytes_b64__"])
    return v


def format_validation_error(e: ValidationError, where: str) -> str:
    """One readable line per problem: `row 3 (id 'x'): field: message`."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {loc}: {msg}" if loc else f"{where}: {msg}")
    return "\n".join(lines)


def make_task(row: dict[str, Any], where: str, *, adhoc: bool = False) -> Task:
    """Build a task, turning pydantic's error into one that names the row and field.

    An unusable ground truth raises GroundTruthError (a TaskValidationError and a
    VerifierError). `adhoc=True`: a task without ground truth (`sandflow run`)."""
    try:
        return Task.model_validate(row, context={"adhoc": adhoc})
    except ValidationError as e:
        message = format_validation_error(e, where)
        if any(isinstance((err.get("ctx") or {}).get("error"), VerifierError) for err in e.errors()):
            raise GroundTruthError(message) from None
        raise TaskValidationError(message) from None


class TaskSet(BaseModel):
    """An ordered set of tasks with unique ids, identified by its content hash."""

    name: str = "tasks"
    source: str = ""
    seed: int | None = None
    tasks: list[Task] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_ids(self) -> TaskSet:
        seen: dict[str, int] = {}
        dups = []
        for i, t in enumerate(self.tasks):
            if t.id in seen:
                dups.append(f"row {i}: id {t.id!r} duplicates row {seen[t.id]}")
            else:
                seen[t.id] = i
        if dups:
            more = f" (and {len(dups) - 5} more)" if len(dups) > 5 else ""
            raise ValueError("duplicate task ids: " + "; ".join(dups[:5]) + more)
        return self

    @classmethod
    def build(cls, tasks: Iterable[Task], **kw: Any) -> TaskSet:
        try:
            return cls(tasks=list(tasks), **kw)
        except ValidationError as e:
            raise TaskValidationError(format_validation_error(e, "task set")) from None

    @property
    def content_hash(self) -> str:
        """sha256 over the tasks' own hashes, in order (name/source are labels, not content)."""
        h = hashlib.sha256()
        for t in self.tasks:
            h.update(t.content_hash.encode())
        return h.hexdigest()

    @property
    def short_hash(self) -> str:
        return self.content_hash[:12]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:  # type: ignore[override]
        return iter(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def by_id(self, task_id: str) -> Task:
        for t in self.tasks:
            if t.id == task_id:
                return t
        raise KeyError(f"no task with id {task_id!r} in {self.name}")

    def summary(self) -> dict[str, Any]:
        """Counts by domain and type, and sizes, for CLI tables and reports."""
        by_domain = Counter(t.domain for t in self.tasks)
        by_type = Counter(t.qa_type or "-" for t in self.tasks)
        file_bytes = [t.input_bytes for t in self.tasks]
        prompt_chars = [len(t.problem_statement) for t in self.tasks]
        return {
            "name": self.name,
            "count": len(self.tasks),
            "content_hash": self.content_hash,
            "by_domain": dict(sorted(by_domain.items())),
            "by_type": dict(sorted(by_type.items())),
            "files": sum(len(t.input_files) for t in self.tasks),
            "file_bytes": sum(file_bytes),
            "max_file_bytes_per_task": max(file_bytes, default=0),
            "prompt_chars_mean": (sum(prompt_chars) / len(prompt_chars)) if prompt_chars else 0,
        }
