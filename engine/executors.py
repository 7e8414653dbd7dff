"""How a run's episodes fan out: the executor interface and the in-process one.

An executor takes a run's `Work`: the planned episodes and a job (ONE attempt of one
episode: a module-level function `job(spec, *args)` that returns the episode's outcome,
raises engine.retry.InfraFailure when the attempt is worth another, EpisodeCancelled
when the run was cancelled), the run's RetryPolicy and its CancelToken. It applies the
policy and hands back (episode, outcome or the exception of its last attempt) as
episodes finish, in any order.

- `ThreadExecutor`: a thread pool in this process (its own, or one shared with other
  runs, e.g. the rollout server's; `max_in_flight` then bounds this run's share).
- Prefect's task runner: supplied by flows/ (flows/executor.py), each episode a named
  Prefect task run with its retries visible in the UI; with Prefect's DaskTaskRunner the
  episodes run on a Dask cluster.

Cancellation: the run's CancelToken. An executor stops submitting once it is set, and
when its caller stops consuming (Ctrl+C, an error) it sets the token itself and waits
for the episodes in flight, which stop at their next step and are recorded as
interrupted: no episode is left running when `map` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from engine.cancel import CancelToken
from engine.plan import EpisodeSpec
from engine.retry import EpisodeCancelled, InfraFailure, RetryPolicy

Job = Callable[..., Any]
Finished = tuple[EpisodeSpec, Any]  # (episode, its outcome or the exception it ended with)


@dataclass(frozen=True)
class Work:
    """What a run hands its executor: `job(spec, *args)` for each of `episodes`, retried
    under `policy`, stopped by `cancel` (see the module docstring)."""

    job: Job
    episodes: list[EpisodeSpec]
    args: tuple[Any, ...]
    policy: RetryPolicy
    cancel: CancelToken

    def not_started(self, ep: EpisodeSpec) -> EpisodeCancelled:
        return EpisodeCancelled(f"episode {ep.key} not started: {self.cancel.reason}")

    def attempts(self, ep: EpisodeSpec) -> Any:
        """Episode `ep` to its end in this thread: its attempts under the policy, none once
        the run is cancelled."""
        if self.cancel.is_set():
            raise self.not_started(ep)
        return self.policy.call_with_retries(lambda: self.job(ep, *self.args), self.cancel)


class Executor(Protocol):
    """Runs a run's episodes; see the module docstring."""

    @property
    def in_process(self) -> bool:
        """Do the episodes run in this process (so a warm pool started here serves them)?"""
        ...

    def map(self, work: Work) -> Iterator[Finished]: ...


class ThreadExecutor:
    """Episodes on threads of this process, at most `max_in_flight` at once."""

    def __init__(self, max_workers: int = 4, pool: ThreadPoolExecutor | None = None, max_in_flight: int | None = None) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers {max_workers}: must be at least 1")
        self.max_workers = max_workers
        self.pool = pool
        self.max_in_flight = max_in_flight or max_workers

    @property
    def in_process(self) -> bool:
        return True

    def map(self, work: Work) -> Iterator[Finished]:
        own = self.pool is None
        pool = self.pool or ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandflow-episode")
        queue = list(reversed(work.episodes))
        running: dict[Future[Any], EpisodeSpec] = {}
        cancel = work.cancel
        clean = False
        try:
            while queue or running:
                while queue and len(running) < self.max_in_flight and not cancel.is_set():
                    ep = queue.pop()
                    running[pool.submit(work.attempts, ep)] = ep
                if not running:  # cancelled with episodes never submitted
                    for ep in reversed(queue):
                        yield ep, work.not_started(ep)
                    queue.clear()
                    break
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    ep = running.pop(fut)
                    exc = fut.exception()
                    yield ep, (fut.result() if exc is None else exc)
            clean = True
        finally:
            if not clean:  # the consumer stopped (Ctrl+C, an error): stop, then wait for them
                cancel.cancel("the run was interrupted")
                for fut in running:
                    fut.cancel()
                with contextlib.suppress(BaseException):
                    wait(list(running))
            if own:
                pool.shutdown(wait=clean, cancel_futures=True)


def outcome_of(result: Any) -> Any:
    """The outcome an InfraFailure carries (the last attempt's record), else None."""
    return result.outcome if isinstance(result, InfraFailure) else None
