"""A wall-clock bound on each Docker engine call the backend makes.

The docker SDK's timeout is a socket read timeout: a call whose engine keeps the
connection open without answering (seen under 16-way load: get_archive/remove calls
stuck well past the SDK's 120 s) holds the episode's thread indefinitely. Here a call
runs on its own daemon thread and the caller waits at most `timeout` seconds; past it the
caller gets a SandboxError (infrastructure: retry the episode) and the stuck thread is
left to finish on its own. A call that creates something (a container) can pass
`late=`: it is applied to a result that arrives after the caller gave up, so a late
container is removed instead of leaking.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sandbox import settings
from sandbox.base import SandboxError

log = logging.getLogger("sandflow.sandbox")

T = TypeVar("T")
SETTING = "engine_call_timeout_s"  # named in the error: the setting that raises the bound


def call_timeout() -> float:
    """Seconds one engine call may take (HostSettings.engine_call_timeout_s, default 60)."""
    return settings.current().engine_call_timeout_s


class EngineTimeout(SandboxError):
    """An engine call did not answer within its bound."""


class _Gate:
    """At most `engine_calls_in_flight` engine calls at once, per process.

    256 sandboxes opened at once sent 256 `start`s (and as many creates for their network
    namespace holders) to the engine together: it answered them all, but slowly (p50 33 s,
    the slowest past 60 s), so the time bound failed 29 of them as a hung engine (issue
    #22.6: the rl_env benchmark's 256 level). The engine is no faster at 256 calls than at
    a few (containerd and runc do the work); queued here, each call takes ~a second, and
    its bound measures the engine, not the queue in front of it.

    A caller waiting for a slot is not waiting on a hung engine as long as calls finish:
    it gives up (EngineTimeout) only when no call has finished for its whole bound. A call
    abandoned at its bound keeps its slot until it returns, so a stuck engine cannot
    gather an unbounded number of stuck calls.
    """

    def __init__(self) -> None:
        self.busy = 0
        self.cond = threading.Condition()
        self.last_done = time.monotonic()

    def enter(self, what: str, limit: float) -> None:
        size = settings.current().engine_calls_in_flight
        with self.cond:
            since = time.monotonic()
            while self.busy >= size:
                left = max(since, self.last_done) + limit - time.monotonic()
                if left <= 0:
                    raise EngineTimeout(
                        f"the Docker engine finished none of its {self.busy} calls in flight "
                        f"within {limit:.0f}s, so {what} was not sent (bound: the {SETTING} "
                        "setting, SANDFLOW_ENGINE_CALL_TIMEOUT_S); the engine is overloaded or stuck"
                    )
                self.cond.wait(left)
            self.busy += 1

    def leave(self) -> None:
        with self.cond:
            self.busy -= 1
            self.last_done = time.monotonic()
            self.cond.notify()


_GATE = _Gate()


def _forget_in_child() -> None:
    """A forked child has none of its parent's calls in flight (their threads stayed behind)."""
    global _GATE
    _GATE = _Gate()


os.register_at_fork(after_in_child=_forget_in_child)


def bounded(
    what: str,
    fn: Callable[[], T],
    *,
    timeout: float | None = None,
    late: Callable[[Any], object] | None = None,
) -> T:
    """`fn()` on a helper thread; its result or exception, or EngineTimeout after `timeout`."""
    limit = call_timeout() if timeout is None else timeout
    done = threading.Event()
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def run() -> None:
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller as is
            error = e
        finally:
            _GATE.leave()
        with lock:
            box.update(done=True, result=result, error=error)
            abandoned = box.get("abandoned", False)
        done.set()
        if abandoned and late is not None and error is None:
            try:
                late(result)
            except Exception as e:  # noqa: BLE001 - best effort; gc is the backstop
                log.warning("late result of %s not cleaned up: %s", what, e)

    _GATE.enter(what, limit)
    try:
        threading.Thread(target=run, name=f"sandflow-engine-{what}", daemon=True).start()
    except BaseException:
        _GATE.leave()
        raise
    if not done.wait(limit):
        with lock:
            if not box.get("done"):
                box["abandoned"] = True
                raise EngineTimeout(
                    f"the Docker engine did not answer {what} within {limit:.0f}s "
                    f"(bound: the {SETTING} setting, SANDFLOW_ENGINE_CALL_TIMEOUT_S); the engine is overloaded or stuck"
                )
    if box["error"] is not None:
        raise box["error"]
    return box["result"]
