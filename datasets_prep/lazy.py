"""Lazy package exports (PEP 562), written once for every package that has them.

Why: `sandflow --help` imports the packages of every command, and a package that imported
its public names eagerly would pull in DuckDB, the openai SDK or docker on the way.
datasets_prep, tasks, warehouse and rl each name their exports in a table instead; this
is the module-level `__getattr__` that imports a name from its home on first use. It
lives in the lowest layer so every package above may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of package `package`: a name of `exports` (name -> its home module)
    is imported from there; any other name is an AttributeError, as for any module."""

    def __getattr__(name: str) -> Any:
        home = exports.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
