"""Where datasets_prep finds its offline data: handed in, never read from the environment.

The application resolves these (sandflow/config.py: SANDFLOW_PYTHON_DOCS, SANDFLOW_NLTK_DATA,
a config file) and calls `configure(...)` when it starts; a library user calls it the same
way or keeps the defaults. The size bounds on task data have their own home
(datasets_prep/limits.py, `limits.configure`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")


@dataclass(frozen=True)
class DataSettings:
    python_docs: Path = DEFAULT_PYTHON_DOCS
    """Debian's python3.11-doc reST sources (the long_context suite's Python docs)."""
    nltk_data: Path | None = None
    """NLTK's data folder for the IFBench verifier's punkt_tab tables. None:
    $XDG_CACHE_HOME/sandflow/nltk_data (~/.cache/sandflow/nltk_data)."""

    def nltk_data_dir(self) -> Path:
        if self.nltk_data is not None:
            return self.nltk_data
        return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sandflow" / "nltk_data"


_current = DataSettings()


def current() -> DataSettings:
    return _current


def configure(settings: DataSettings | None = None, **changes: Any) -> DataSettings:
    """Use `settings` (or the current ones with `changes`) from now on; returns the previous."""
    global _current
    changes = {k: Path(v) if isinstance(v, str) else v for k, v in changes.items()}
    previous = _current
    _current = dataclasses.replace(settings or previous, **changes)
    return previous
