"""Episode progress events: planned, started, attempt failed, finished.

The engine (engine/run.py) reports completions as its executor hands them back (any
executor, Dask included); episode bodies running in this process also report when
they start, so "running" is exact in-process and an estimate (submitted minus
finished) with Dask. Listeners are in-process only: nothing here reaches Prefect's API
or the warehouse. Each entry point renders them its own way: the terminal's progress
bar (sandflow/commands/progress.py) subscribes here; the Prefect flow shows each
episode as a task run; the rollout server streams its own NDJSON events.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

Listener = Callable[[str, dict[str, Any]], None]

_lock = threading.Lock()
_listeners: list[Listener] = []


def subscribe(fn: Listener) -> Callable[[], None]:
    with _lock:
        _listeners.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _listeners:
                _listeners.remove(fn)

    return unsubscribe


def emit(kind: str, **data: Any) -> None:
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        with contextlib.suppress(Exception):  # a broken display must never break a run
            fn(kind, data)


def planned(total: int, skipped: int, run_id: str) -> None:
    emit("planned", total=total, skipped=skipped, run_id=run_id)


def started(key: str) -> None:
    emit("started", key=key)


def attempt_failed(key: str) -> None:
    emit("attempt_failed", key=key)


def finished(key: str, ok: bool, termination: str | None) -> None:
    emit("finished", key=key, ok=ok, termination=termination)
