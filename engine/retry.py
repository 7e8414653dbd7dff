"""ONE retry policy for episodes, and ONE definition of what is retryable.

Only infrastructure failures are retried: the sandbox or its engine broke
(`sandbox_error`), the model endpoint kept failing (`model_error`, after the model
client's own retries of single calls). A model's own ending (no submit within max
steps, its context exhausted, its wall clock) is a result and is graded; an
interrupted episode (a cancel) is never retried: resume re-runs it.

Every attempt re-records the same episode key; the warehouse keeps the latest. Two
ways to apply the policy, the same numbers: in-process executors call
`call_with_retries` (tenacity, its back-off sleeps cut short by the run's cancel
token), Prefect's task runner gets `prefect_task_options()` (each retry visible in its
UI). After the last attempt the episode's record says what failed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, Field
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from engine.cancel import CancelToken

RETRYABLE = frozenset({"sandbox_error", "model_error"})

T = TypeVar("T")


def is_retryable(termination: str | None) -> bool:
    """Does an episode that ended this way deserve another attempt?"""
    return termination in RETRYABLE


class InfraFailure(RuntimeError):
    """One attempt of an episode ended in an infrastructure failure (retryable).

    `outcome` is what the attempt returned (its record), so the last attempt's result
    is not lost when the retries run out."""

    def __init__(self, message: str, outcome: Any = None, run_id: str | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.run_id = run_id

    def __reduce__(self) -> Any:  # picklable with its outcome (Dask workers)
        return (type(self), (str(self), self.outcome, self.run_id))


class EpisodeCancelled(RuntimeError):
    """The run was cancelled: the episode stopped at a turn boundary or never started.
    Recorded as `interrupted` when it had started; never retried; resume re-runs it."""


class RetryPolicy(BaseModel):
    """How often and how patiently an episode is retried after an infrastructure failure."""

    retries: int = Field(2, ge=0, le=20, description="retries after the first attempt")
    delay_s: float = Field(2.0, ge=0, description="the first retry's delay; doubles each time")
    max_delay_s: float = Field(30.0, ge=0)
    jitter: float = Field(0.5, ge=0, le=1, description="up to this fraction of a delay is added at random")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def delays(self) -> list[float]:
        """The delay before each retry (without jitter)."""
        return [min(self.max_delay_s, self.delay_s * 2**i) for i in range(self.retries)]

    def prefect_task_options(self) -> dict[str, Any]:
        """The same policy as Prefect task options (retry_condition_fn is the caller's)."""
        return {
            "retries": self.retries,
            "retry_delay_seconds": self.delays() or 0,
            "retry_jitter_factor": self.jitter or None,
        }

    def _wait(self, state: RetryCallState) -> float:
        delays = self.delays()
        base = delays[min(state.attempt_number, len(delays)) - 1] if delays else 0.0
        return base * (1 + random.uniform(0, self.jitter))

    def call_with_retries(
        self,
        attempt: Callable[[], T],
        cancel: CancelToken | None = None,
        on_retry: Callable[[InfraFailure], object] | None = None,
    ) -> T:
        """`attempt()` until it returns; InfraFailure is retried (unless cancelled), anything
        else propagates. After the last attempt its InfraFailure is raised."""
        token = cancel or CancelToken()

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if on_retry is not None and isinstance(exc, InfraFailure):
                on_retry(exc)

        def pause(seconds: float) -> None:  # a back-off that a cancel cuts short
            token.wait(seconds)

        retrying = Retrying(
            retry=retry_if_exception(lambda e: isinstance(e, InfraFailure) and not token.is_set()),
            stop=stop_after_attempt(self.attempts),
            wait=self._wait,
            sleep=pause,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(attempt)
