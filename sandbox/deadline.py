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
from collections.abc import Callable
from typing import Any, TypeVar

from sandbox.base import SandboxError

log = logging.getLogger("sandflow.sandbox")

T = TypeVar("T")
ENV_TIMEOUT = "SANDFLOW_ENGINE_CALL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0


def call_timeout() -> float:
    """Seconds one engine call may take (SANDFLOW_ENGINE_CALL_TIMEOUT_S, default 60)."""
    raw = os.environ.get(ENV_TIMEOUT, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise SandboxError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise SandboxError(f"{ENV_TIMEOUT}={raw!r} must be > 0 seconds")
    return value


class EngineTimeout(SandboxError):
    """An engine call did not answer within its bound."""


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
        with lock:
            box.update(done=True, result=result, error=error)
            abandoned = box.get("abandoned", False)
        done.set()
        if abandoned and late is not None and error is None:
            try:
                late(result)
            except Exception as e:  # noqa: BLE001 - best effort; gc is the backstop
                log.warning("late result of %s not cleaned up: %s", what, e)

    threading.Thread(target=run, name=f"sandflow-engine-{what}", daemon=True).start()
    if not done.wait(limit):
        with lock:
            if not box.get("done"):
                box["abandoned"] = True
                raise EngineTimeout(
                    f"the Docker engine did not answer {what} within {limit:.0f}s "
                    f"(bound: {ENV_TIMEOUT}); the engine is overloaded or stuck"
                )
    if box["error"] is not None:
        raise box["error"]
    return box["result"]
