"""THE task-set loader: one call from any source to a validated TaskSet.

Every command and flow loads task sets here (`sandflow tasks prepare`, `sandflow flows
prepare`, the run and score flows, `sandflow bench`). SOURCE is a built-in suite name,
`hf:NAME[:CONFIG][@SPLIT]`, a saved HF dataset directory, a task-set file sandflow wrote
(its name, seed and content hash are kept), or a local table. Tables whose rows already
are tasks (id, domain, problem_statement, ...: ours or the peer's) load as they are; any
other table goes through the column-mapping converter (context -> files, question -> prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from datasets_prep.convert import DEFAULT_CHUNK_CHARS, ColumnMapping, convert_rows
from datasets_prep.io import rows_to_taskset
from datasets_prep.task import TaskSet

TASK_COLUMNS = ("id", "domain", "problem_statement")
TASKSET_SUFFIXES = (".parquet", ".jsonl", ".json")


def _is_sandflow_set(path: Path) -> bool:
    """A task-set file sandflow wrote (its header keeps the set's name, seed and hash)?"""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except Exception:  # not Parquet at all: the rows loader names the problem
            return False
        return bool(schema.metadata and b"sandflow.taskset" in schema.metadata)
    from datasets_prep.io import iter_jsonl

    try:
        first = next(iter(iter_jsonl(path)), None)
    except Exception:  # unreadable: the rows loader names the problem
        return False
    return first is not None and "__taskset__" in first[1]


def looks_like_tasks(rows: list[dict[str, Any]]) -> bool:
    return bool(rows) and all(c in rows[0] for c in TASK_COLUMNS)


def load_taskset(
    source: str,
    *,
    seed: int = 0,
    size: int | None = None,
    mapping: str | ColumnMapping | None = None,
    domain: str = "general",
    qa_type: str | None = None,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    id_prefix: str = "task",
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TaskSet:
    """A validated TaskSet from SOURCE (see the module doc). Raises TaskValidationError,
    SourceError, SourceMissing, UnknownSuite or ValueError with a message naming the
    row/field/file."""
    from datasets_prep.io import read_taskset
    from datasets_prep.loaders import SourceError, load_rows
    from datasets_prep.suites import SUITES, build_suite

    path = Path(source).expanduser()
    is_file = not source.startswith("hf:") and path.suffix in TASKSET_SUFFIXES
    if source in SUITES and mapping is None:
        ts = build_suite(source, seed=seed, size=size)
    elif is_file and not path.exists():
        raise SourceError(f"task set file {path} does not exist")
    elif mapping is None and not source.startswith("hf:") and not path.exists():
        raise SourceError(
            f"{source!r} is neither a built-in suite ({', '.join(SUITES)}) nor a hub dataset "
            "(written hf:NAME[:CONFIG][@SPLIT]), and there is no such file"
        )
    elif is_file and mapping is None and _is_sandflow_set(path):
        ts = read_taskset(path)
        if size is not None and size < len(ts):
            ts = TaskSet.build(ts.tasks[:size], name=ts.name, source=ts.source, seed=ts.seed)
    else:
        rows = load_rows(source, limit=size)
        if not rows:
            raise SourceError(f"{source!r} has no rows")
        label = Path(source.removeprefix("hf:")).stem.replace("/", "_")
        if mapping is None and looks_like_tasks(rows):
            ts = rows_to_taskset(enumerate(rows), ours=False, name=label, source=source)
        else:
            m = mapping if isinstance(mapping, ColumnMapping) else ColumnMapping.parse(mapping)
            base = None if source.startswith("hf:") else Path(source).resolve().parent
            tasks = convert_rows(rows, m, domain=domain, qa_type=qa_type, id_prefix=id_prefix,
                                 max_chars=chunk_chars, base_dir=base, progress=progress)
            ts = TaskSet.build(tasks, name=label, source=source)
    if name:
        ts.name = name
    return ts
