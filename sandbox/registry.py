"""Every sandbox this process opened, so none outlives it.

close() is the normal path. This registry is the safety net for the others: interpreter
exit (atexit), SIGINT and SIGTERM (a handler that removes our live sandboxes, then chains
to whatever handler was there before, so Prefect's or the user's handling still runs).
Cleanups registered with add_cleanup run after the sandboxes are gone (the netns pool
removes its idle holders there). Only *this process's* sandboxes are touched; other
runs' containers are never removed here (that is `sandflow sandbox gc`'s job, by label).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_LOCK = threading.RLock()  # re-entrant: the signal handler runs on the main thread
_LIVE: dict[int, Any] = {}  # id(sandbox) -> sandbox (anything with a .kill() method)
_ATEXIT_DONE = False
_SIGNALS_DONE = False
_PREVIOUS: dict[int, Any] = {}
_CLEANUPS: list[Callable[[], object]] = []  # run after the sandboxes are gone (netns holders)


def register(sandbox: Any) -> None:
    with _LOCK:
        _LIVE[id(sandbox)] = sandbox
    _install()


def unregister(sandbox: Any) -> None:
    with _LOCK:
        _LIVE.pop(id(sandbox), None)


def add_cleanup(fn: Callable[[], object]) -> None:
    """Run `fn` after every kill_all (exit, signals): for resources sandboxes leave idle."""
    with _LOCK:
        if fn not in _CLEANUPS:
            _CLEANUPS.append(fn)
    _install()


def live() -> list[Any]:
    with _LOCK:
        return list(_LIVE.values())


def kill_all(signum: int | None = None) -> int:
    """Remove every live sandbox of this process; returns how many were removed.

    With `signum`, each sandbox is marked `killed_by_signal`, so the episode using it can
    tell "the user stopped the run" (interrupted) from "the engine failed" (sandbox_error).
    """
    boxes = live()
    for box in boxes:
        if signum is not None:
            with contextlib.suppress(Exception):
                box.killed_by_signal = signum
        with contextlib.suppress(Exception):  # best effort on the way out
            box.kill()
    with _LOCK:
        cleanups = list(_CLEANUPS)
    for fn in cleanups:
        with contextlib.suppress(Exception):
            fn()
    return len(boxes)


def _handler(signum: int, frame: FrameType | None) -> None:
    kill_all(signum)
    prev = _PREVIOUS.get(signum)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _install() -> None:
    """atexit once; signal handlers once, as soon as we are on the main thread."""
    global _ATEXIT_DONE, _SIGNALS_DONE
    with _LOCK:
        if not _ATEXIT_DONE:
            atexit.register(kill_all)
            _ATEXIT_DONE = True
        if _SIGNALS_DONE or threading.current_thread() is not threading.main_thread():
            # signal.signal only works on the main thread; until then atexit covers normal
            # exits, and a sandbox's PID 1 exits by itself when our connection drops.
            return
        _SIGNALS_DONE = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if prev is _handler or prev == signal.SIG_IGN:
                # SIG_IGN: the process ignores it (a background job started by a
                # non-interactive shell ignores SIGINT); a stray one must not kill every
                # sandbox of a run that goes on (found in a nohup'd test run).
                continue
            _PREVIOUS[sig] = prev
            signal.signal(sig, _handler)
            _INSTALLED_SIGNALS.add(sig)


_INSTALLED_SIGNALS: set[int] = set()


def install_signal_handlers() -> Callable[[], None]:
    """Install the handlers now (from the main thread); returns an uninstaller for tests."""
    _install()

    def undo() -> None:
        global _SIGNALS_DONE
        _SIGNALS_DONE = False
        for sig in list(_INSTALLED_SIGNALS):
            if signal.getsignal(sig) is _handler:
                signal.signal(sig, _PREVIOUS.get(sig, signal.SIG_DFL))
            _INSTALLED_SIGNALS.discard(sig)

    return undo
