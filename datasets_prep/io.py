"""Reading and writing task sets: Parquet (ours), JSONL, and the peer's row format.

Our Parquet keeps every Task field without loss: `ground_truth` and `metadata` are
JSON text, `input_files` is a list of (name, text, data) structs so text and bytes
both survive, and the file's schema metadata records the set's name, seed and
content hash. Peer rows (llm-in-sandbox: id, domain, problem_statement,
ground_truth, input_files, qa_type) load as they are and export back.

Writes are atomic: the whole set is validated first, written to a temporary
name in the target directory and renamed, so a failed set leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from datasets_prep import limits as L
from datasets_prep.rows import peer_row, task_from_row
from datasets_prep.task import Task, TaskSet, encode_bytes

FORMAT_KEY = b"sandflow.taskset"
FORMAT_VERSION = 1
PEER_COLUMNS = ("id", "domain", "problem_statement", "ground_truth", "input_files", "qa_type")

Format = Literal["parquet", "jsonl"]


class TaskSetIOError(ValueError):
    """A file could not be read or written as a task set; the message names the file."""


# --------------------------------------------------------------------------- helpers
def check_size(path: Path, what: str = "file") -> int:
    """Stat before reading: a 2 GB file is refused without allocating anything."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise TaskSetIOError(f"{what} {str(path)!r} does not exist") from None
    if size > L.LIMITS.max_table_bytes:
        raise TaskSetIOError(
            L.over_limit(f"{what} {str(path)!r}", size, "max_table_bytes", "per table")
            + "; raise it or split the file"
        )
    return size


def decode_utf8(data: bytes, where: str) -> str:
    """Strict UTF-8 decode whose error names the line and byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TaskSetIOError(
            f"{where} line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "re-encode the file as UTF-8"
        ) from None


def guess_format(path: Path) -> Format:
    suffixes = "".join(path.suffixes[-2:]).lower()
    if suffixes.endswith((".parquet", ".pq")):
        return "parquet"
    if suffixes.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    raise TaskSetIOError(f"cannot tell the format of {str(path)!r}: use a .parquet or .jsonl name")


_UMASK = os.umask(0)
os.umask(_UMASK)  # read once at import; mkstemp's files are 0600, the result should not be


def atomic_write(path: Path, write: Any) -> None:
    """Call write(tmp_path), then rename onto `path`; remove the temp file on any failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------- rows
def row_to_task(row: dict[str, Any], index: int | str, *, ours: bool = False) -> Task:
    """One table row (ours or the peer's) -> a validated Task; errors name the row
    (datasets_prep.rows is the one row contract). `index` is a row number, or a ready
    label such as "line 7" for JSONL."""
    return task_from_row(row, where=index if isinstance(index, str) else f"row {index}", json_fields=ours)


# ------------------------------------------------------------------------ Parquet
def _arrow_schema() -> Any:
    import pyarrow as pa

    file_t = pa.struct([("name", pa.string()), ("text", pa.large_string()), ("data", pa.large_binary())])
    return pa.schema(
        [
            ("id", pa.string()),
            ("domain", pa.string()),
            ("problem_statement", pa.large_string()),
            ("ground_truth", pa.large_string()),
            ("input_files", pa.list_(file_t)),
            ("qa_type", pa.string()),
            ("verifier", pa.string()),
            ("metadata", pa.large_string()),
        ]
    )


def _set_header(ts: TaskSet) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "name": ts.name,
        "source": ts.source,
        "seed": ts.seed,
        "count": len(ts),
        "content_hash": ts.content_hash,
    }


def write_parquet(ts: TaskSet, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema().with_metadata({FORMAT_KEY: json.dumps(_set_header(ts)).encode()})
    # input_files is built from flat arrays + offsets: pyarrow converting lists of
    # dicts row by row is ~7x slower than writing the whole file.
    offsets, names, texts, datas = [0], [], [], []
    for t in ts.tasks:
        for k, v in t.input_files.items():
            names.append(k)
            texts.append(v if isinstance(v, str) else None)
            datas.append(v if isinstance(v, bytes) else None)
        offsets.append(len(names))
    file_t = schema.field("input_files").type.value_type
    files = pa.StructArray.from_arrays(
        [pa.array(names, pa.string()), pa.array(texts, pa.large_string()), pa.array(datas, pa.large_binary())],
        fields=list(file_t),
    )
    arrays = [
        pa.array([t.id for t in ts.tasks], pa.string()),
        pa.array([t.domain for t in ts.tasks], pa.string()),
        pa.array([t.problem_statement for t in ts.tasks], pa.large_string()),
        pa.array([json.dumps(t.ground_truth, ensure_ascii=False, default=str) for t in ts.tasks], pa.large_string()),
        pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), files),
        pa.array([t.qa_type for t in ts.tasks], pa.string()),
        pa.array([t.verifier for t in ts.tasks], pa.string()),
        pa.array([json.dumps(t.metadata, ensure_ascii=False, default=str) for t in ts.tasks], pa.large_string()),
    ]
    table = pa.Table.from_arrays(arrays, schema=schema)
    atomic_write(path, lambda p: pq.write_table(table, p, compression="zstd"))


def write_peer_parquet(ts: TaskSet, path: Path) -> None:
    """Peer rows; input_files as JSON text, which the peer's runner decodes (and which
    survives HF `datasets`, unlike dicts with differing keys)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [peer_row(t) for t in ts.tasks]
    for r in rows:
        r["input_files"] = json.dumps(r["input_files"], ensure_ascii=False)
    schema = pa.schema([(c, pa.large_string() if c != "id" else pa.string()) for c in PEER_COLUMNS])
    table = pa.Table.from_pylist(rows, schema=schema)
    atomic_write(path, lambda p: pq.write_table(table, p, compression="zstd"))


def read_parquet_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    import pyarrow.parquet as pq

    check_size(path)
    try:
        pf = pq.ParquetFile(path)
        table = pf.read()
    except Exception as e:  # pyarrow raises several types for a bad file
        raise TaskSetIOError(f"{str(path)!r} is not a readable Parquet file: {e}") from None
    meta = (table.schema.metadata or {}).get(FORMAT_KEY)
    header = json.loads(meta) if meta else None
    return table.to_pylist(), header


# -------------------------------------------------------------------------- JSONL
def iter_jsonl(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; errors name the line."""
    check_size(path)
    data = path.read_bytes()
    text = decode_utf8(data, repr(str(path)))
    stripped = text.lstrip()
    whole: Any = None
    if path.suffix.lower() == ".json" and stripped.startswith("{") and "\n" in stripped.rstrip():
        try:  # one JSON document, e.g. {"data": [...]}, rather than JSON Lines
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict):
            lists = [k for k in ("data", "rows", "examples", "train", "test") if isinstance(whole.get(k), list)]
            if not lists:
                raise TaskSetIOError(
                    f"{str(path)!r} holds one JSON object; a table needs a list of row objects, JSON Lines, "
                    "or an object with a 'data'/'rows'/'examples' list"
                )
            stripped = "["
            whole = whole[lists[0]]
    if path.suffix.lower() == ".json" and stripped.startswith("["):
        try:
            items = whole if isinstance(whole, list) else json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskSetIOError(f"{str(path)!r} line {e.lineno}: invalid JSON ({e.msg})") from None
        for i, obj in enumerate(items):
            if not isinstance(obj, dict):
                raise TaskSetIOError(f"{str(path)!r} item {i}: expected an object, got {type(obj).__name__}")
            yield i + 1, obj
        return
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskSetIOError(f"{str(path)!r} line {n}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TaskSetIOError(f"{str(path)!r} line {n}: expected an object, got {type(obj).__name__}")
        yield n, obj


def write_jsonl(ts: TaskSet, path: Path, *, peer: bool = False) -> None:
    """One task per line. Ours: the first line is a header object; bytes as base64."""

    def write(p: Path) -> None:
        with open(p, "w", encoding="utf-8") as f:
            if not peer:
                f.write(json.dumps({"__taskset__": _set_header(ts)}) + "\n")
            for t in ts.tasks:
                row = peer_row(t) if peer else t.canonical()
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")

    atomic_write(path, write)


# ------------------------------------------------------------------------- public
def rows_to_taskset(rows: Iterable[tuple[int | str, dict[str, Any]]], *, ours: bool, **kw: Any) -> TaskSet:
    tasks = [row_to_task(row, index, ours=ours) for index, row in rows]
    return TaskSet.build(tasks, **kw)


def read_taskset(path: str | Path) -> TaskSet:
    """Read a task set written by sandflow, or peer rows (Parquet/JSONL/JSON)."""
    path = Path(path)
    fmt = guess_format(path)
    if fmt == "parquet":
        rows, header = read_parquet_rows(path)
        ours = header is not None
        ts = rows_to_taskset(
            enumerate(rows), ours=ours, name=(header or {}).get("name") or path.stem,
            source=(header or {}).get("source") or str(path), seed=(header or {}).get("seed"),
        )
    else:
        items = list(iter_jsonl(path))
        header = None
        if items and "__taskset__" in items[0][1]:
            header = items.pop(0)[1]["__taskset__"]
        # Our JSONL keeps ground_truth as native JSON, so no decoding is needed.
        ts = rows_to_taskset(
            ((f"line {n}", obj) for n, obj in items), ours=False,
            name=(header or {}).get("name") or path.stem,
            source=(header or {}).get("source") or str(path), seed=(header or {}).get("seed"),
        )
    if header and header.get("content_hash") and header["content_hash"] != ts.content_hash:
        raise TaskSetIOError(
            f"{str(path)!r}: content hash mismatch (header {header['content_hash'][:12]}, "
            f"tasks {ts.short_hash}): the file was edited or truncated"
        )
    return ts


def write_taskset(ts: TaskSet, path: str | Path, *, peer: bool = False) -> Path:
    """Write atomically in the format the suffix names; `peer=True` for llm-in-sandbox rows."""
    path = Path(path)
    fmt = guess_format(path)
    if fmt == "parquet":
        (write_peer_parquet if peer else write_parquet)(ts, path)
    else:
        write_jsonl(ts, path, peer=peer)
    return path


__all__ = [
    "TaskSetIOError",
    "read_taskset",
    "write_taskset",
    "row_to_task",
    "encode_bytes",
]
