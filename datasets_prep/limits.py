"""Every size bound on task data, in one place.

A task is refused — with its row, field and the limit named — before anything large
is read, copied or sent to a sandbox. The defaults are generous for real long-context
work (a whole play is ~150 KB; a 1M-token prompt is ~4 MB of text) and small enough
that a runaway document or a pasted dump is caught early.

Each limit has an environment variable (read once, at import). Code reads the limits
through the module attribute `LIMITS` at call time, so a test or an embedding
application can swap in its own `DataLimits` (`limits.LIMITS = DataLimits(...)`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

MiB = 1024 * 1024


@dataclass(frozen=True)
class DataLimits:
    """Bounds on one task and on the files tasks come from."""

    max_file_bytes: int = 64 * MiB
    """One input file (a document placed in the sandbox, or a context_path document)."""
    max_text_bytes: int = 4 * MiB
    """One text field of a task: the problem statement, the ground truth, the metadata."""
    max_task_bytes: int = 256 * MiB
    """A whole task: its input files plus its text fields."""
    max_files_per_task: int = 10_000
    """Input files of one task (also: entries of a `sandflow run -i` folder)."""
    max_table_bytes: int = 1024 * MiB
    """A table file read by the loaders (checked with stat before reading)."""

    @classmethod
    def from_env(cls) -> DataLimits:
        """Defaults overridden by SANDFLOW_MAX_FILE_BYTES, SANDFLOW_MAX_TEXT_BYTES, ..."""
        values: dict[str, int] = {}
        for f in fields(cls):
            raw = os.environ.get(env_name(f.name))
            if raw is None or not raw.strip():
                continue
            try:
                values[f.name] = int(raw)
            except ValueError:
                raise ValueError(
                    f"{env_name(f.name)}={raw!r} is not a whole number of bytes (or files)"
                ) from None
            if values[f.name] < 1:
                raise ValueError(f"{env_name(f.name)}={raw!r} must be at least 1")
        return cls(**values)


def env_name(field: str) -> str:
    """`max_text_bytes` -> `SANDFLOW_MAX_TEXT_BYTES` (named in every limit error)."""
    return f"SANDFLOW_{field.upper()}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def over_limit(what: str, size: int, field: str, per: str) -> str:
    """The sentence of a limit error: what, how big, the limit, and how to raise it."""
    limit = getattr(LIMITS, field)
    return (
        f"{what} is {human_bytes(size)}, over the limit of {human_bytes(limit)} {per} "
        f"({env_name(field)})"
    )


LIMITS = DataLimits.from_env()
