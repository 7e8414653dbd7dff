"""A Dask worker that gives its work back when its Docker engine goes away.

Each Dask worker opens its episodes' sandboxes on its own engine (DOCKER_HOST). When that
engine stops answering, the worker would otherwise keep taking episodes and failing them
within seconds (the retries run on the same worker), draining the queue into failures.
Load this module in every worker:

    dask worker tcp://scheduler:8786 --preload flows.dask_worker

and the worker checks its engine every second; after `FAILURES` checks in a row that got
no answer, it closes itself (and its nanny). The scheduler then hands its episodes, the
running ones included, to the other workers, exactly as after a kill -9 of the worker:
each episode is recorded once, by the attempt that finishes (docs/pipeline.md). Bring
the worker back (a supervisor's restart) once the engine answers again; a worker started
while its engine is down closes itself the same way, so it never takes work it cannot do.

Start workers with DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False as well (the stack
profiler can deadlock a busy worker on CPython 3.11: flows/prefect_env.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from sandbox.engine import engine_address, ping

log = logging.getLogger("sandflow.dask_worker")

INTERVAL_S = 1.0
FAILURES = 2  # checks in a row; each waits up to PING_TIMEOUT_S
PING_TIMEOUT_S = 5.0


class EngineWatch:
    """The watch of one worker: a daemon thread that pings the engine, closes the worker."""

    def __init__(self, worker: Any, interval_s: float = INTERVAL_S, failures: int = FAILURES) -> None:
        self.worker = worker
        self.interval_s = interval_s
        self.failures = failures
        self.address = engine_address()
        self.stopped = threading.Event()
        self.closed_because: str | None = None
        self.thread = threading.Thread(target=self._watch, name="sandflow-engine-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _watch(self) -> None:
        missed = 0
        while not self.stopped.wait(self.interval_s):
            why = ping(self.address, PING_TIMEOUT_S)
            missed = missed + 1 if why else 0
            if missed >= self.failures:
                self.closed_because = why
                self._close(why or "")
                return

    def _close(self, why: str) -> None:
        log.error("sandflow: closing this Dask worker, its Docker engine is gone: %s", why)
        coro = self.worker.close(executor_wait=False, nanny=True, reason=f"sandflow: {why}")
        asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop)


def dask_setup(worker: Any) -> None:
    """Dask's preload hook (`--preload flows.dask_worker`)."""
    watch = EngineWatch(worker)
    worker._sandflow_engine_watch = watch  # kept alive with the worker; found by tests
    watch.start()


def dask_teardown(worker: Any) -> None:
    watch = getattr(worker, "_sandflow_engine_watch", None)
    if watch is not None:
        watch.stopped.set()
