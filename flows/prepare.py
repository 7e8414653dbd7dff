"""The prepare flow: a source (built-in suite, hub dataset, local file) -> a task-set file.

The file name carries the set's content hash, so the same source and seed give the
same file and a run records exactly which data it used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from warehouse import DEFAULT_ROOT


def taskset_path(root: str, ts: Any) -> Path:
    return Path(root).expanduser() / "tasksets" / f"{ts.name}-{ts.short_hash}.parquet"


@flow(name="sandflow-prepare", log_prints=False)
def prepare_flow(
    source: str = "smoke",
    warehouse: str = DEFAULT_ROOT,
    out: str | None = None,
    limit: int | None = None,
    seed: int | None = None,
    mapping: str | None = None,
) -> dict[str, Any]:
    """Load `source` with THE task-set loader (datasets_prep.prepare.load_taskset: the same
    as `sandflow tasks prepare`, --mapping included) and write it where runs find it."""
    from datasets_prep.io import write_taskset
    from datasets_prep.prepare import load_taskset

    ts = load_taskset(source, seed=seed or 0, size=limit, mapping=mapping)
    path = Path(out).expanduser() if out else taskset_path(warehouse, ts)
    if not path.exists():
        write_taskset(ts, path)
    summary = ts.summary() if hasattr(ts, "summary") else {}
    return {"task_set": str(path), "name": ts.name, "hash": ts.content_hash, "tasks": len(ts), "summary": summary}
