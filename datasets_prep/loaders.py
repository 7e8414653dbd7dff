"""Load tables of rows from local files or the Hugging Face hub.

Local json/jsonl/parquet/csv files are read directly (sizes checked before
reading, errors name the line), so they always work offline. `hf:NAME[:CONFIG][@SPLIT]`
goes through HF `datasets`. Unless the user has set HF_HUB_OFFLINE themselves, the
hub is probed once with a short connect timeout and the offline flags are set when
it does not answer: a missing hub then fails at once with a clear sentence instead
of retrying for ~23 s.
"""

from __future__ import annotations

import csv
import io
import os
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from datasets_prep.io import TaskSetIOError, check_size, decode_utf8, iter_jsonl, read_parquet_rows

LOCAL_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet", ".pq", ".csv", ".tsv")


class SourceError(ValueError):
    """A source could not be loaded; the message says what to do instead."""


def parse_hf_source(source: str) -> tuple[str, str | None, str]:
    """`hf:NAME[:CONFIG][@SPLIT]` -> (name, config, split); split defaults to 'train'."""
    spec = source.removeprefix("hf:")
    split = "train"
    if "@" in spec:
        spec, split = spec.rsplit("@", 1)
    name, _, config = spec.partition(":")
    if not name:
        raise SourceError(f"{source!r}: give a dataset name, e.g. hf:openai/gsm8k:main@test")
    return name, (config or None), split


def hub_reachable(timeout: float = 1.5) -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def configure_hf_offline() -> bool:
    """Put `datasets`/`huggingface_hub` offline unless the user chose (HF_HUB_OFFLINE, their
    own convention); return True when offline.

    They read their flags from the environment when imported; the process environment is
    left alone here (no library changes it), so their module flags are set instead."""
    if "HF_HUB_OFFLINE" in os.environ:
        offline = os.environ["HF_HUB_OFFLINE"].strip().lower() in ("1", "true", "yes", "on")
    else:
        offline = not hub_reachable()
    if offline:
        import datasets  # noqa: F401  (reads its flags now; they are overridden just below)

        _patch_imported_constants()
    return offline


def _patch_imported_constants() -> None:
    """The offline flags on the imported modules, where `datasets` and `huggingface_hub`
    look them up on every call."""
    for module, attr in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_DATASETS_OFFLINE"),
    ):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, attr):
            setattr(mod, attr, True)


def load_hf(source: str, *, limit: int | None = None) -> list[dict[str, Any]]:
    name, config, split = parse_hf_source(source)
    offline = configure_hf_offline()
    import datasets

    datasets.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        if offline:
            raise SourceError(
                f"Cannot load {name!r} (config {config!r}, split {split!r}): the Hugging Face hub is not "
                "reachable from this machine (offline mode) and the dataset is not in the local HF cache. "
                "Download it where the hub is reachable and pass the local .parquet/.jsonl file instead."
            ) from None
        raise SourceError(f"Cannot load {name!r} (config {config!r}, split {split!r}) from the hub: {e}") from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [dict(r) for r in ds]


def load_saved_dataset(path: Path, split: str | None, *, limit: int | None = None) -> list[dict[str, Any]]:
    """A directory written by `datasets.save_to_disk`."""
    import datasets

    d = datasets.load_from_disk(str(path))
    if isinstance(d, datasets.DatasetDict):
        split = split or ("train" if "train" in d else next(iter(d)))
        d = d[split]
    if limit is not None:
        d = d.select(range(min(limit, len(d))))
    return [dict(r) for r in d]


def load_csv(path: Path) -> list[dict[str, Any]]:
    check_size(path)
    text = decode_utf8(path.read_bytes(), repr(str(path)))
    delim = "\t" if path.suffix.lower() == ".tsv" else ","
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delim)
    rows = []
    for row in reader:
        if None in row:
            raise SourceError(f"{str(path)!r} line {reader.line_num}: more fields than the header has")
        rows.append({k: (v if v != "" else None) for k, v in row.items()})
    return rows


def load_local(path: Path, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a local table file, in file order."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            rows, _ = read_parquet_rows(path)
        elif suffix in (".json", ".jsonl", ".ndjson"):
            rows = [obj for _, obj in iter_jsonl(path)]
        elif suffix in (".csv", ".tsv"):
            rows = load_csv(path)
        else:
            raise SourceError(
                f"{str(path)!r}: unsupported file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}"
            )
    except TaskSetIOError as e:
        raise SourceError(str(e)) from None
    return rows[:limit] if limit is not None else rows


def load_rows(source: str, *, limit: int | None = None, split: str | None = None) -> list[dict[str, Any]]:
    """Rows from `hf:NAME[:CONFIG][@SPLIT]`, a saved HF dataset directory, or a local file."""
    if source.startswith("hf:"):
        return load_hf(source, limit=limit)
    path = Path(source)
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return load_saved_dataset(path, split, limit=limit)
        raise SourceError(f"{source!r} is a directory, not a table file or a saved HF dataset")
    if not path.exists():
        raise SourceError(
            f"{source!r}: no such file, and not a built-in suite (see `sandflow tasks suites`); "
            "a hub dataset is written hf:NAME[:CONFIG][@SPLIT]"
        )
    return load_local(path, limit=limit)
