"""Every size bound on task data, in one place.

A task is refused — with its row, field and the limit named — before anything large
is read, copied or sent to a sandbox. The defaults are generous for real long-context
work (a whole play is ~150 KB; a 1M-token prompt is ~4 MB of text) and small enough
that a runaway document or a pasted dump is caught early.

Each limit is a setting of the application (SANDFLOW_MAX_FILE_BYTES, ..., or the config
file: sandflow/config.py), which hands them in with `configure(DataLimits(...))`; nothing
here reads the environment. Code reads the limits through the module attribute `LIMITS`
at call time, so a test or an embedding application can swap in its own.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} ({env_name(f.name)}) must be at least 1")


def configure(limits: DataLimits) -> DataLimits:
    """Use `limits` from now on (the application's settings); returns the previous ones."""
    global LIMITS
    previous, LIMITS = LIMITS, limits
    return previous


def env_name(field: str) -> str:
    """`max_text_bytes` -> `SANDFLOW_MAX_TEXT_BYTES`: the setting named in every limit error
    (the application resolves it; this module never reads it)."""
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


LIMITS = DataLimits()
