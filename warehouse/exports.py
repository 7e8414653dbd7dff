"""Files written *out* of the warehouse for other tools: the RL exports (verl/rllm task
rows, trajectories, token rows) that `sandflow flows rollouts` writes.

Why here and not in analysis/: analysis/ computes rows and stays pure (no files, no
engine), so its functions are tested and reused on plain data; writing Parquet is the
store's job. These files are not warehouse tables (no table tag, never read by the
views): each is one Parquet file in an explicit schema (stable types even for empty or
sparse rows), written to a hidden temporary name and renamed, so a reader sees the whole
file or none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def write_export(rows: list[dict[str, Any]], schema: pa.Schema, path: Path) -> Path:
    """Write `rows` in `schema` to `path` (zstd), atomically; returns `path`.

    No rows: a file with the schema and no row group. pyarrow's writer gave an empty table
    one row group of 0 rows, on which `datasets` crashes ("ArrowInvalid: BatchSize must be
    greater than 0", issue #36); without one, pyarrow, pandas and `datasets` streaming read
    0 rows with every column (a non-streaming `load_dataset` cannot build an empty split
    from any file: "corresponds to no data")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(f".{path.name}.tmp")
    if table.num_rows:
        pq.write_table(table, tmp, compression="zstd")
    else:
        pq.ParquetWriter(tmp, schema, compression="zstd").close()
    tmp.replace(path)
    return path
