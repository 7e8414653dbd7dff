"""The exact tasks a run ran, kept with the run (issue #22).

A run's tasks used to be known only by the source it was started from (a suite name, a
file path), so scoring and RL exports rebuilt them -- and a suite that came out different
in another process, or a file edited since, gave tasks the run never ran. Now every way
of running episodes keeps the tasks it ran here, and readers use these:

    <root>/_tasks/run_id=<id>/<time-ordered id>.parquet   task-set files (datasets_prep.io)

`flows run` writes its whole task set once, in order, before the first episode; the
rollout server writes each batch's tasks; `SandboxEnv` and `sandflow run --warehouse`
write each task the first time the process sees it. Files are only ever added (atomic
rename; each carries its content hash, checked when read), so a run's tasks are the
union of its files in the order they were written.

Comparisons match tasks by content, not by name: `task_versions(run)` maps each task
id to the content hashes recorded under it, and `unlike_tasks(a, b)` says, in one
sentence, why two runs cannot be paired task by task (or None when they can).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets_prep.limits as task_limits
from datasets_prep.io import atomic_write, read_taskset, write_taskset
from datasets_prep.task import Task, TaskSet, TaskValidationError, decode_maybe_bytes, make_task
from warehouse.layout import Layout, new_id
from warehouse.schema import check_run_id

TASKS_DIR = "_tasks"
_KEPT: set[tuple[str, str, str]] = set()  # (root, run_id, task hash) this process has written
_KEPT_LOCK = threading.Lock()


class RunTasksError(ValueError):
    """A run's recorded tasks cannot be used as asked; the message says why."""


def tasks_dir(layout: Layout, run_id: str) -> Path:
    return layout.root / TASKS_DIR / f"run_id={check_run_id(run_id)}"


def _files(layout: Layout, run_id: str) -> list[Path]:
    d = tasks_dir(layout, run_id)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("*.parquet") if not p.name.startswith("."))


def keep_tasks(layout: Layout, run_id: str, tasks: Iterable[Task], *, name: str = "tasks") -> int:
    """Record the tasks of `run_id` that this process has not recorded yet; returns how many
    were written. Safe from any thread; a task already written by this process is skipped
    without touching the disk (SandboxEnv calls this once per episode)."""
    root = str(layout.root)
    new: list[Task] = []
    with _KEPT_LOCK:
        for t in tasks:
            key = (root, run_id, t.content_hash)
            if key not in _KEPT and all(t.content_hash != n.content_hash for n in new):
                new.append(t)
    if not new:
        return 0
    layers: list[dict[str, Task]] = []  # one file holds one version per id
    for t in new:
        layer = next((x for x in layers if t.id not in x), None)
        if layer is None:
            layer = {}
            layers.append(layer)
        layer[t.id] = t
    for layer in layers:
        ts = TaskSet.build(list(layer.values()), name=name)
        write_taskset(ts, tasks_dir(layout, run_id) / f"{new_id()}-{ts.short_hash}.parquet")
        with _KEPT_LOCK:
            _KEPT.update((root, run_id, t.content_hash) for t in layer.values())
    return len(new)


def run_tasks(layout: Layout, run_id: str) -> TaskSet | None:
    """The tasks `run_id` ran, in the order first recorded (None: it recorded none, e.g. a
    run from before sandflow kept them). Raises RunTasksError when one id was recorded with
    two different contents (such a run has no single task set)."""
    files = _files(layout, run_id)
    if not files:
        return None
    seen: dict[str, Task] = {}
    name = None
    for path in files:
        ts = read_taskset(path)  # TaskSetIOError on a file whose content hash does not match
        name = name or ts.name
        for t in ts.tasks:
            if t.id in seen and seen[t.id].content_hash != t.content_hash:
                raise RunTasksError(
                    f"run {run_id!r} ran two different tasks under the id {t.id!r}; its episodes "
                    "cannot be matched to one task set"
                )
            seen.setdefault(t.id, t)
    return TaskSet.build(list(seen.values()), name=name or "tasks", source=f"run:{run_id}")


# ------------------------------------------------------------------ ad-hoc tasks
# `sandflow run`'s query has no ground truth, so it is no task a task set holds (those are
# tasks a verifier can score, and compare/score/export read them). A replay still needs
# it (its files are part of the sandbox's state): it is kept beside them as its canonical
# JSON (`Task.canonical`, bytes as base64) with its content hash, read back only by
# `adhoc_task`, checked against the hash and re-validated as an ad-hoc task.
ADHOC_PREFIX = "adhoc-"


def keep_adhoc_task(layout: Layout, run_id: str, task: Task) -> Path:
    """Keep one ad-hoc task of `run_id` (idempotent: its name is its content hash)."""
    path = tasks_dir(layout, run_id) / f"{ADHOC_PREFIX}{task.content_hash[:20]}.json"
    if not path.exists():
        body = json.dumps({"content_hash": task.content_hash, "task": task.canonical()},
                          ensure_ascii=False, default=str)  # fmt: skip
        atomic_write(path, lambda tmp: Path(tmp).write_text(body, encoding="utf-8"))
    return path


def adhoc_task(layout: Layout, run_id: str, task_id: str) -> Task | None:
    """The ad-hoc task `task_id` that `run_id` kept (None: none). RunTasksError names a file
    that is too big, not JSON, edited since (hash) or not a valid task."""
    d = tasks_dir(layout, run_id)
    if not d.is_dir():
        return None
    bound = 2 * task_limits.LIMITS.max_task_bytes  # base64 and JSON escaping at most double the task
    for path in sorted(d.glob(f"{ADHOC_PREFIX}*.json")):
        try:
            if path.stat().st_size > bound:
                raise RunTasksError(f"{path}: {path.stat().st_size} bytes, over {bound} (2x max_task_bytes)")
            obj = json.loads(path.read_text(encoding="utf-8"))
            row = obj["task"]
            if row.get("id") != task_id:
                continue
            row["input_files"] = {k: decode_maybe_bytes(v) for k, v in (row.get("input_files") or {}).items()}
            task = make_task(row, str(path), adhoc=True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, TaskValidationError) as exc:
            if isinstance(exc, RunTasksError):
                raise
            raise RunTasksError(f"{path}: not a kept ad-hoc task ({type(exc).__name__}: {exc})") from None
        if task.content_hash != obj.get("content_hash"):
            raise RunTasksError(f"{path}: content hash mismatch: the file was edited")
        return task
    return None


def task_versions(layout: Layout, run_id: str) -> dict[str, set[str]]:
    """task id -> the content hashes recorded under it by `run_id` ({} when none)."""
    out: dict[str, set[str]] = {}
    for path in _files(layout, run_id):
        for t in read_taskset(path).tasks:
            out.setdefault(t.id, set()).add(t.content_hash)
    return out


def unlike_tasks(layout: Layout, a: str, b: str, runs: dict[str, dict[str, Any]]) -> str | None:
    """Why runs `a` and `b` cannot be compared task by task, in one sentence; None when they
    can. `runs`: their rows of the runs table (for the task-set hash of older runs).

    Both recorded their tasks: every task id both ran must be the same task (content), and
    neither may have run two tasks under one id. Otherwise both must name the same task-set
    hash; a run that records neither its tasks nor a task-set hash is refused."""
    va, vb = task_versions(layout, a), task_versions(layout, b)
    if va and vb:
        for run, v in ((a, va), (b, vb)):
            twice = sorted(i for i, h in v.items() if len(h) > 1)
            if twice:
                return (f"run {run!r} ran different tasks under the same id ({_some(twice)}): its "
                        "episodes cannot be paired with another run's by task id")
        shared = va.keys() & vb.keys()
        if not shared:
            return f"runs {a!r} and {b!r} ran no task in common: there is nothing to pair"
        differ = sorted(i for i in shared if va[i] != vb[i])
        if differ:
            return (f"runs {a!r} and {b!r} ran different tasks under the same id ({len(differ)} of "
                    f"{len(shared)} shared ids: {_some(differ)}): they are not paired")
        return None
    ha, hb = (_set_hash(layout, r, runs) for r in (a, b))
    if ha and hb:
        if ha != hb:
            return (f"runs {a!r} and {b!r} ran different task sets (content hash {ha[:12]} vs "
                    f"{hb[:12]}): tasks with the same id may differ, so they are not paired")
        return None
    missing = a if not ha else b
    return (f"run {missing!r} records neither the tasks it ran nor a task-set hash (recorded "
            "before sandflow kept them): its tasks cannot be matched to the other run's, so the "
            "runs are not paired")


def _set_hash(layout: Layout, run_id: str, runs: dict[str, dict[str, Any]]) -> str:
    """The run's task-set hash: the one its row names, else that of its recorded tasks."""
    named = str((runs.get(run_id) or {}).get("dataset_hash") or "")
    if named:
        return named
    try:
        ts = run_tasks(layout, run_id)
    except RunTasksError:
        return ""
    return ts.content_hash if ts is not None else ""


def _some(ids: list[str], n: int = 3) -> str:
    return ", ".join(repr(i) for i in ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")
