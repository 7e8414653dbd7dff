"""Prefect's task runner as the engine's executor (engine.executors.Executor).

Each episode is one Prefect task run (flows/episode.py), named task/mode/sample, its
retries following the run's RetryPolicy and visible in the UI; the task runner is the
flow's own (a thread pool by default, a Dask cluster with --task-runner dask).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prefect.context import FlowRunContext
from prefect.task_runners import ThreadPoolTaskRunner

from engine.executors import Work
from engine.plan import EpisodeSpec
from flows.episode import make_episode_task


def in_process_runner() -> bool:
    """Do this flow's tasks run in this process (the thread task runner)?"""
    ctx = FlowRunContext.get()
    return ctx is not None and isinstance(ctx.task_runner, ThreadPoolTaskRunner)


def _quote_for_runner() -> Callable[[Any], Any]:
    """prefect's quote() with the thread runner, else the identity.

    Why: for every task run Prefect walks each parameter field by field looking for
    upstream futures (an episode has none): ~2/3 of its engine CPU per episode, measured.
    quote() skips that walk. Not with Dask: its runner hands a quoted parameter to the
    worker as a bare tuple.
    """
    if not in_process_runner():
        return lambda value: value
    from prefect.utilities.annotations import quote

    return quote


RESUBMITS = 3  # times one episode is submitted again after the Dask scheduler was lost


def _lost_with_the_scheduler(exc: BaseException) -> bool:
    """Was this future cancelled because the Dask client lost its scheduler?"""
    return getattr(exc, "reason", None) == "scheduler-connection-lost"


def _release(fut: Any) -> None:
    """Let Dask forget an episode whose result we hold. A result Dask still keeps lives
    only in its worker's memory: when that worker dies, the scheduler runs the episode
    AGAIN to rebuild it (measured: 7 finished episodes re-run after one kill -9 of a
    worker in benchmarks/two_engines.py), and the warehouse's latest attempt would then
    differ from the outcome this run already counted."""
    wrapped = getattr(fut, "wrapped_future", None)
    release = getattr(wrapped, "release", None)
    if callable(release):
        with contextlib.suppress(Exception):
            release()


def _wait_for_the_scheduler(timeout_s: float = 120.0) -> None:
    """Until this flow's Dask client has reconnected (a future submitted while it is still
    connecting is cancelled with the ones it lost)."""
    import time

    ctx = FlowRunContext.get()
    client = getattr(ctx.task_runner, "_client", None) if ctx else None
    deadline = time.monotonic() + timeout_s
    while client is not None and client.status != "running" and time.monotonic() < deadline:
        if client.status in ("closing", "closed"):
            return
        time.sleep(0.2)


class PrefectExecutor:
    """Episodes as Prefect task runs on the current flow's task runner (call inside a flow).

    The job must be flows.episode.episode_body's shape: `(spec, run)`, module-level
    (a Dask worker imports it)."""

    @property
    def in_process(self) -> bool:
        return in_process_runner()

    def map(self, work: Work) -> Iterator[tuple[EpisodeSpec, Any]]:
        from prefect.exceptions import TerminationSignal
        from prefect.futures import as_completed

        episodes, args, cancel = work.episodes, work.args, work.cancel
        task = make_episode_task(work.policy)
        wrap = _quote_for_runner()
        futures: dict[Any, EpisodeSpec] = {}  # submitted, not yet handed back (waited for on a stop)
        clean = False
        try:
            pending = {task.submit(wrap(ep), *map(wrap, args)): ep for ep in episodes}
            futures.update(pending)
            resubmitted: dict[int, int] = {}
            while pending:
                batch, pending = pending, {}
                for fut in as_completed(list(batch)):
                    ep = batch[fut]
                    try:
                        out = fut.result()
                    except Exception as exc:  # retries exhausted (infra), a cancel, or a bug
                        _release(fut)
                        futures.pop(fut, None)  # done: nothing to wait for on a stop
                        if _lost_with_the_scheduler(exc) and resubmitted.get(id(ep), 0) < RESUBMITS and not cancel.is_set():
                            # The Dask scheduler went away (restarted) and took every future
                            # with it; the client reconnects to its address by itself. The
                            # episode runs again from the start: its key is recorded once,
                            # by whichever attempt finishes last (docs/pipeline.md).
                            resubmitted[id(ep)] = resubmitted.get(id(ep), 0) + 1
                            _wait_for_the_scheduler()
                            again = task.submit(wrap(ep), *map(wrap, args))
                            pending[again] = futures[again] = ep
                            continue
                        yield ep, exc
                        continue
                    _release(fut)
                    futures.pop(fut, None)
                    yield ep, out
            clean = True
        except TerminationSignal:  # SIGTERM through Prefect's bridge: stop as Ctrl+C does
            raise KeyboardInterrupt from None
        finally:
            if not clean:
                # Stop in-flight episodes at their next turn (recorded as interrupted, sandbox
                # closed), let queued ones return at once; only then may the model server stop.
                cancel.cancel("the run was interrupted")
                for fut in futures:
                    with contextlib.suppress(BaseException):
                        fut.wait(timeout=args[0].wall_clock_s if args else None)
