"""File names from hostile ids, and writes that never leave the output folder.

Episode and task ids come from data (a task file, a peer's folder): they may hold `/`,
`..`, NUL, control characters or thousands of characters. A name is built from the
safe characters of the id; an id that had to be changed gets a short hash of the raw id
appended, so two ids never map to one file. Every write goes to a temporary name in the
output folder and is renamed over the final name: a symlink planted at that name is
replaced, never followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_STEM = 80  # characters kept from the id (the rest is in the hash)


class OutputPathError(ValueError):
    """A name that would leave the output folder (never expected from safe_name)."""


def safe_name(raw: str, suffix: str = "") -> str:
    """`raw` as a file name of [A-Za-z0-9._-] (no leading dot), unique per raw id."""
    stem = _UNSAFE.sub("_", raw)[:MAX_STEM].lstrip(".") or "_"
    if stem != raw:
        stem = f"{stem}-{hashlib.sha256(raw.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"
    return stem + suffix


def inside(folder: Path, name: str) -> Path:
    """folder/name, checked to be a direct child of `folder` (no separators, no `..`)."""
    if not name or "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise OutputPathError(f"refusing file name {name!r}: not a plain name inside {folder}")
    return folder / name  # one component, not `..`: a direct child (a symlink there is replaced)


def prepare_out(folder: Path) -> Path:
    """Create the output folder (parents too); refuse a path that is a file."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"output folder {folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def atomic_open(folder: Path, name: str, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file in `folder`; on success it is renamed to `name` (atomic)."""
    target = inside(folder, name)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        f: IO[Any] = os.fdopen(fd, mode) if "b" in mode else os.fdopen(fd, mode, encoding="utf-8")
        with f:
            yield f
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(folder: Path, name: str, text: str) -> Path:
    with atomic_open(folder, name) as f:
        f.write(text)
    return inside(folder, name)
