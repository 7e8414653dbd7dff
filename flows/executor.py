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

from engine.cancel import CancelToken
from engine.plan import EpisodeSpec
from engine.retry import RetryPolicy
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


class PrefectExecutor:
    """Episodes as Prefect task runs on the current flow's task runner (call inside a flow).

    The job must be flows.episode.episode_body's shape: `(spec, run)`, module-level
    (a Dask worker imports it)."""

    @property
    def in_process(self) -> bool:
        return in_process_runner()

    def map(
        self,
        job: Callable[..., Any],
        episodes: list[EpisodeSpec],
        args: tuple[Any, ...],
        policy: RetryPolicy,
        cancel: CancelToken,
    ) -> Iterator[tuple[EpisodeSpec, Any]]:
        from prefect.exceptions import TerminationSignal
        from prefect.futures import as_completed

        task = make_episode_task(policy)
        wrap = _quote_for_runner()
        futures: dict[Any, EpisodeSpec] = {}
        clean = False
        try:
            futures = {task.submit(wrap(ep), *map(wrap, args)): ep for ep in episodes}
            for fut in as_completed(list(futures)):
                ep = futures[fut]
                try:
                    out = fut.result()
                except Exception as exc:  # retries exhausted (infra), a cancel, or a bug
                    yield ep, exc
                    continue
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
