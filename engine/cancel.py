"""Cancellation as an explicit token that every layer checks.

Why a token and not signal hooks: an episode runs in a worker thread, which never sees
KeyboardInterrupt, and the reasons to stop a run are more than Ctrl+C (a trainer that
disconnected, a budget reached, a full warehouse disk). Whoever decides to stop calls
`token.cancel(reason)`; the agent loop checks the token after every model reply and tool
call (tasks.loop.run_episode's `cancel`), episodes not started yet never start, the
retry policy stops retrying, and callbacks registered with `on_cancel` run once (the
rollout server removes its batch's sandboxes there, cutting an in-flight command).

A run's token is also findable by its run id in this process (`token_for`): an episode
body that only gets plain values (a Prefect task parameter, a Dask worker) looks its
run's token up there. In another process it finds a fresh token that is never set.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class Cancelled(Exception):
    """Raised by `CancelToken.check` once the token is set; carries the reason."""


class CancelToken:
    """A thread-safe, one-way switch with a reason and callbacks."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], object]] = []
        self.reason: str | None = None
        # how an episode stopped by this token ends (tasks.records.Termination):
        # "interrupted", or "budget_exhausted" when the run's budget was reached (engine.budget)
        self.termination = "interrupted"

    def cancel(self, reason: str = "cancelled", termination: str = "interrupted") -> bool:
        """Set the token (first reason wins) and run the callbacks; True the first time."""
        with self._lock:
            if self._event.is_set():
                return False
            self.reason = reason
            self.termination = termination
            self._event.set()
            callbacks, self._callbacks = list(self._callbacks), []
        for fn in callbacks:
            with contextlib.suppress(Exception):  # one broken callback must not stop the rest
                fn(reason)
        return True

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to `timeout`, cut short by a cancel; True when cancelled."""
        return self._event.wait(timeout)

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled(self.reason or "cancelled")

    def on_cancel(self, fn: Callable[[str], object]) -> None:
        """Run `fn(reason)` when the token is cancelled (at once if it already is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        with contextlib.suppress(Exception):
            fn(self.reason or "cancelled")


_lock = threading.Lock()
_tokens: dict[str, CancelToken] = {}


def token_for(run_id: str) -> CancelToken:
    """The token of `run_id` in this process (a new, unset one if none is registered)."""
    with _lock:
        token = _tokens.get(run_id)
        if token is None:
            token = _tokens[run_id] = CancelToken()
        return token


def renew_after_budget(run_id: str, termination: str) -> CancelToken:
    """The token of `run_id` in this process, replaced by a fresh one if a spent budget
    set it (ending `termination`): a long-lived process (a Dask worker) that stopped a
    run on its budget runs the run's resume with a higher budget."""
    with _lock:
        token = _tokens.get(run_id)
        if token is None or (token.is_set() and token.termination == termination):
            token = _tokens[run_id] = CancelToken()
        return token


@contextlib.contextmanager
def registered(run_id: str, token: CancelToken) -> Iterator[CancelToken]:
    """`token` is the token of `run_id` in this process for the block."""
    with _lock:
        previous = _tokens.get(run_id)
        _tokens[run_id] = token
    try:
        yield token
    finally:
        with _lock:
            if _tokens.get(run_id) is token:
                if previous is None:
                    del _tokens[run_id]
                else:
                    _tokens[run_id] = previous
