"""The terminal's (or a log's) episode progress: done, running, failed, retries, rate, ETA.

With a terminal the display is rich's live bar; without one (output to a file, a
scheduled job, CI) it is one plain line every few seconds while something changes,
and a heartbeat line when nothing does, so a log shows a run is alive and how far
along it is (`SANDFLOW_PROGRESS_INTERVAL_S`, default 5 s).

Fed by the run flow's in-process events (engine/progress.py); the flows never print.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.progress import subscribe


class EpisodeTally:
    """Counts fed by the events above; shared by both displays (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total: int | None = None
        self.skipped = 0
        self.run_id: str | None = None
        self.running: set[str] = set()
        self.done = 0
        self.failed = 0
        self.retries = 0
        self.t_planned: float | None = None
        self.version = 0  # bumped on every change

    def apply(self, kind: str, data: dict[str, Any]) -> None:
        with self.lock:
            if kind == "planned":
                if self.run_id is not None and data.get("run_id") != self.run_id:
                    # another run in the same display (a data build's synthesis, then its
                    # calibration run): its counts start from zero
                    self.running.clear()
                    self.done = self.failed = self.retries = 0
                self.total = int(data["total"])
                self.skipped = int(data.get("skipped") or 0)
                self.run_id = data.get("run_id")
                self.t_planned = time.monotonic()
            elif kind == "started":
                self.running.add(data["key"])
            elif kind == "attempt_failed":
                self.retries += 1
                self.running.discard(data["key"])
            elif kind == "finished":
                self.running.discard(data["key"])
                self.done += 1
                if not data.get("ok"):
                    self.failed += 1
            else:
                return
            self.version += 1

    def rate(self, now: float | None = None) -> float:
        """Episodes per second since the run planned its work (0 before that)."""
        if self.t_planned is None:
            return 0.0
        elapsed = max(1e-9, (now or time.monotonic()) - self.t_planned)
        return self.done / elapsed

    def eta_s(self, now: float | None = None) -> float | None:
        rate = self.rate(now)
        if self.total is None or rate <= 0:
            return None
        return max(0, self.total - self.done) / rate


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def progress_interval_s() -> float:
    """Seconds between log lines (SANDFLOW_PROGRESS_INTERVAL_S; at least 0.05)."""
    try:
        return max(0.05, float(os.environ.get("SANDFLOW_PROGRESS_INTERVAL_S", "5")))
    except ValueError:
        return 5.0


class LineEpisodeProgress:
    """Plain progress lines for a log: one every `interval_s` while counts change, a
    heartbeat every `heartbeat_s` while they don't, and a last line at the end.

    A line reads ``episodes 7/24 done, 1 running, 0 failed, 0 retries, 0.03 ep/s,
    elapsed 4m12s, ETA 9m30s``; nothing is printed before the run has planned its work.
    """

    def __init__(
        self,
        description: str = "episodes",
        write: Callable[[str], None] | None = None,
        interval_s: float | None = None,
        heartbeat_s: float = 60.0,
    ) -> None:
        self._description = description
        self._write = write or _stderr_line
        self.interval_s = progress_interval_s() if interval_s is None else interval_s
        self.heartbeat_s = heartbeat_s
        self.tally = EpisodeTally()
        self._t0 = time.monotonic()
        self._printed_version = -1
        self._last_line_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsub: Callable[[], None] | None = None
        self._announced = False

    def line(self, now: float | None = None) -> str:
        now = now or time.monotonic()
        t = self.tally
        with t.lock:
            total = "?" if t.total is None else str(t.total)
            return (
                f"{self._description} {t.done}/{total} done, {len(t.running)} running, "
                f"{t.failed} failed, {t.retries} retries, {t.rate(now):.2f} ep/s, "
                f"elapsed {_duration(now - self._t0)}, ETA {_duration(t.eta_s(now))}"
            )

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        self.tally.apply(kind, data)
        if kind == "planned" and not self._announced:
            self._announced = True
            extra = f" ({data['skipped']} done before: resumed)" if data.get("skipped") else ""
            self._write(
                f"{self._description}: run {data.get('run_id')}, {data['total']} to do{extra}"
            )

    def tick(self, now: float | None = None, final: bool = False) -> bool:
        """Print a line if one is due; True if it printed (the timer thread calls this)."""
        now = now or time.monotonic()
        t = self.tally
        if t.total is None and not final:
            return False  # Prefect still starting: nothing to count yet
        changed = t.version != self._printed_version
        due = now - self._last_line_at >= (self.interval_s if changed else self.heartbeat_s)
        if not (final or due):
            return False
        if final and not changed and self._printed_version >= 0:
            return False
        self._printed_version = t.version
        self._last_line_at = now
        self._write(self.line(now))
        return True

    def _loop(self) -> None:
        while not self._stop.wait(min(self.interval_s, 1.0)):
            with contextlib.suppress(Exception):  # a broken display must never break a run
                self.tick()

    def __enter__(self) -> LineEpisodeProgress:
        self._t0 = time.monotonic()
        self._unsub = subscribe(self._on_event)
        self._thread = threading.Thread(target=self._loop, name="sandflow-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._unsub:
            self._unsub()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.tally.total is not None:
            with contextlib.suppress(Exception):
                self.tick(final=True)


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class RichEpisodeProgress:
    """Episode progress for `console`: rich's live bar on a terminal, else plain log lines
    (`LineEpisodeProgress`) written through the same console (use as a context manager)."""

    def __init__(self, description: str = "episodes", console: Any = None) -> None:
        from sandflow.console import console as stdout_console

        self._console = console or stdout_console()
        self._lines: LineEpisodeProgress | None = None
        if not self._console.is_terminal:
            self._lines = LineEpisodeProgress(description, write=self._print_line)
            return
        self._init_bar(description)

    def _print_line(self, text: str) -> None:
        self._console.print(text, markup=False, highlight=False, soft_wrap=True)
        with contextlib.suppress(Exception):
            self._console.file.flush()

    def _init_bar(self, description: str) -> None:
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
            console=self._console,
            transient=False,
        )
        self._description = description
        self._task: Any = None
        self.tally = EpisodeTally()
        self._lock = threading.Lock()  # one event at a time: the bar never goes back
        self._unsub: Callable[[], None] | None = None
        self._t0: float | None = None

    def __enter__(self) -> RichEpisodeProgress:
        if self._lines is not None:
            self._lines.__enter__()
            return self
        self._progress.start()
        self._task = self._progress.add_task(
            f"{self._description} [dim](starting Prefect)[/]",
            total=None,
            running=0,
            failed=0,
            retries=0,
            rate="-",
        )
        self._t0 = time.monotonic()
        self._unsub = subscribe(self._on_event)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._lines is not None:
            self._lines.__exit__(exc_type, *exc)
            return
        if self._unsub:
            self._unsub()
        if exc_type is not None and self.tally.done == 0 and self._task is not None:
            # failed before any episode ended (a bad endpoint, a bad task set): the error
            # message is the whole story; an empty bar under it would only confuse
            self._progress.remove_task(self._task)
        self._progress.stop()

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        t = self.tally
        with self._lock:
            before = t.run_id
            t.apply(kind, data)  # the counting is EpisodeTally's; this only draws
            if kind == "planned":
                if before not in (None, t.run_id):
                    self._progress.reset(self._task)  # another run in the same display
                desc = f"{self._description} [dim]{data['run_id']}[/]"
                if data.get("skipped"):
                    desc += f" [dim](resumed: {data['skipped']} done before)[/]"
                self._progress.update(self._task, total=data["total"], description=desc)
            elapsed = max(1e-9, time.monotonic() - (self._t0 or time.monotonic()))
            self._progress.update(
                self._task,
                completed=t.done,
                running=len(t.running),
                failed=t.failed,
                retries=t.retries,
                rate=f"{t.done / elapsed:.2f}",
            )
