"""Two separate bounds on a run: live sandboxes and concurrent model calls.

Why two: a sandbox episode holds its container for its whole life but calls the
model only part of the time, and an LLM-mode episode holds no container at all.
One number cannot protect both the Docker engine (daemon saturation is the most
common complaint at high concurrency) and a rate-limited endpoint.

In one process the bounds are threading semaphores, shared by every episode of that
process. Across processes (Dask workers, several runs on one host) a *global limit*
can be added: a function `(name, timeout_s) -> context manager` handed in by the
caller (flows/ hands Prefect's global concurrency limits, flows/limits.py); the
engine itself knows no orchestrator.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from tasks.model import ModelClient, ModelConfig, ModelError

SANDBOX_LIMIT = "sandflow-sandboxes"
MODEL_LIMIT = "sandflow-model-calls"

# (name of the limit, seconds the caller may wait or None) -> a context manager holding
# one unit; raises SlotTimeout (or TimeoutError) when none came free in time. Any other
# error while taking the unit is its service failing (an orchestrator's API answering 500
# while its database restarts): GlobalLimitUnavailable, an infrastructure failure the
# run's retry policy retries. An error giving the unit back is logged, never the
# episode's: the service expires what it lent (Prefect: the slot's lease).
GlobalLimit = Callable[[str, float | None], AbstractContextManager[Any]]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_semaphores: dict[tuple[str, int], threading.BoundedSemaphore] = {}


def semaphore(name: str, limit: int) -> threading.BoundedSemaphore:
    """The process-wide semaphore for (name, limit); created on first use."""
    with _lock:
        key = (name, limit)
        if key not in _semaphores:
            _semaphores[key] = threading.BoundedSemaphore(limit)
        return _semaphores[key]


class SlotTimeout(TimeoutError):
    """No unit of a bounded resource came free within the time the caller had left."""


class GlobalLimitUnavailable(RuntimeError):
    """The service behind a global limit failed while a unit was being taken (engine.episode
    turns it into an InfraFailure: retried under the run's RetryPolicy)."""


def _enter_global(name: str, limit: AbstractContextManager[Any], timeout_s: float | None) -> None:
    try:
        limit.__enter__()
    except TimeoutError:
        raise SlotTimeout(f"the global limit {name!r} had no free slot within {timeout_s:.1f}s") from None
    except Exception as exc:
        raise GlobalLimitUnavailable(
            f"the global limit {name!r} could not be taken (its service failed): "
            f"{type(exc).__name__}: {str(exc)[:300]}"
        ) from exc


def _exit_global(name: str, limit: AbstractContextManager[Any]) -> Callable[..., bool]:
    def exit_(et: Any, ev: Any, tb: Any) -> bool:
        try:
            return bool(limit.__exit__(et, ev, tb))
        except Exception as exc:
            if exc is ev:  # the body's own error, passed through
                raise
            log.warning("the global limit %r was not given back (%s: %s); its service expires it",
                        name, type(exc).__name__, str(exc)[:300])  # fmt: skip
            return False

    return exit_


@contextlib.contextmanager
def slot(
    name: str,
    limit: int | None,
    global_name: str | None = None,
    timeout_s: float | None = None,
    global_limit: GlobalLimit | None = None,
) -> Iterator[None]:
    """Hold one unit of `name` (in-process) and, when given, of the global limit
    `global_name` (through `global_limit`).

    timeout_s: how long the caller may wait for both (None: as long as it takes); past it
    SlotTimeout, and nothing is held.
    """
    deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
    with contextlib.ExitStack() as stack:
        if limit:
            sem = semaphore(name, limit)
            if not sem.acquire(timeout=None if timeout_s is None else max(0.0, timeout_s)):
                raise SlotTimeout(f"no {name} slot of {limit} came free in {timeout_s:.1f}s")
            stack.callback(sem.release)
        if global_name and global_limit is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            held = global_limit(global_name, left)
            _enter_global(global_name, held, timeout_s)
            stack.push(_exit_global(global_name, held))
        yield


class LimitedClient(ModelClient):
    """A ModelClient whose calls take a model-call slot; shared by all episodes of a process."""

    def __init__(
        self, cfg: ModelConfig, max_calls: int | None, global_limit: GlobalLimit | None = None
    ) -> None:
        super().__init__(cfg)
        self.max_calls = max_calls
        self.global_limit = global_limit

    @contextlib.contextmanager
    def admitted(self, timeout_s: float | None) -> Iterator[float | None]:
        """A call waits for a model-call slot; the wait counts against `timeout_s` (the
        episode's time left), so a run with few slots and many episodes cannot keep an
        episode waiting past its wall clock."""
        t0 = time.monotonic()
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(slot("model", self.max_calls, MODEL_LIMIT, timeout_s, self.global_limit))
            except SlotTimeout as exc:
                raise ModelError(
                    f"waited {time.monotonic() - t0:.1f}s for a model-call slot "
                    f"(--max-model-calls {self.max_calls}), all held by other episodes: {exc}"
                ) from None
            except GlobalLimitUnavailable as exc:  # the call was never made: infrastructure
                raise ModelError(f"no model call made: {exc}") from None
            yield None if timeout_s is None else timeout_s - (time.monotonic() - t0)


_clients: dict[tuple[str, int | None, Any], LimitedClient] = {}


def shared_client(
    cfg: ModelConfig, max_calls: int | None, global_limit: GlobalLimit | None = None
) -> LimitedClient:
    """One pooled client per (config, limit) and process: connection reuse across episodes."""
    key = (cfg.model_dump_json(), max_calls, global_limit)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = LimitedClient(cfg, max_calls, global_limit)
        return client
