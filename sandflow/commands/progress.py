"""The terminal's episode progress bar: done, running, failed, retries, rate, ETA.

Fed by the run flow's in-process events (flows/progress.py); the flows never print.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flows.progress import subscribe


class RichEpisodeProgress:
    """A rich progress bar fed by the events above (use as a context manager)."""

    def __init__(self, description: str = "episodes", console: Any = None) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("running [cyan]{task.fields[running]}[/]"),
            TextColumn("failed [red]{task.fields[failed]}[/]"),
            TextColumn("retries [yellow]{task.fields[retries]}[/]"),
            TextColumn("[green]{task.fields[rate]}[/] ep/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._description = description
        self._task: Any = None
        self._running: set[str] = set()
        self._failed = 0
        self._retries = 0
        self._lock = threading.Lock()
        self._unsub: Callable[[], None] | None = None
        self._t0: float | None = None
        self._done = 0

    def __enter__(self) -> RichEpisodeProgress:
        import time

        self._progress.start()
        self._task = self._progress.add_task(
            f"{self._description} [dim](starting Prefect)[/]", total=None, running=0, failed=0, retries=0, rate="-"
        )
        self._t0 = time.monotonic()
        self._unsub = subscribe(self._on_event)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._unsub:
            self._unsub()
        if exc_type is not None and self._done == 0 and self._task is not None:
            # failed before any episode ended (a bad endpoint, a bad task set): the error
            # message is the whole story; an empty bar under it would only confuse
            self._progress.remove_task(self._task)
        self._progress.stop()

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        import time

        with self._lock:
            if kind == "planned":
                desc = f"{self._description} [dim]{data['run_id']}[/]"
                if data.get("skipped"):
                    desc += f" [dim](resumed: {data['skipped']} done before)[/]"
                self._progress.update(self._task, total=data["total"], description=desc)
            elif kind == "started":
                self._running.add(data["key"])
            elif kind == "attempt_failed":
                self._retries += 1
                self._running.discard(data["key"])
            elif kind == "finished":
                self._running.discard(data["key"])
                self._done += 1
                if not data.get("ok"):
                    self._failed += 1
                self._progress.advance(self._task)
            elapsed = max(1e-9, time.monotonic() - (self._t0 or time.monotonic()))
            self._progress.update(
                self._task,
                running=len(self._running),
                failed=self._failed,
                retries=self._retries,
                rate=f"{self._done / elapsed:.2f}",
            )
