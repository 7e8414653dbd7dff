"""ONE Prefect task per episode (never per turn), for the engine's Prefect executor.

The episode body is the engine's (engine.episode.attempt: one attempt, InfraFailure
when it is worth another); here it gets Prefect's global concurrency limits
(flows/limits.py) and becomes a named task run whose retries follow the run's
RetryPolicy (engine.retry) and are visible in Prefect's UI. Retried: InfraFailure only,
and nothing once the run's cancel token is set.

Every episode of a run gets the same RunSpec (tasks/spec.py), which holds no secret:
Prefect stores task parameters. The API key is looked up in the process that runs the
episode, a Dask worker included.
"""

from __future__ import annotations

from typing import Any

from engine.cancel import token_for
from engine.episode import attempt
from engine.plan import EpisodeSpec
from engine.retry import InfraFailure, RetryPolicy
from flows.limits import prefect_limit
from tasks.spec import RunSpec


def episode_body(spec: EpisodeSpec, run: RunSpec) -> dict[str, Any]:
    """The task body: the engine's attempt, with Prefect's global limits."""
    return attempt(spec, run, prefect_limit)


def retry_infra_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry_condition_fn: retry InfraFailure, nothing else, and nothing after a cancel."""
    try:
        state.result()
    except InfraFailure as exc:
        return not (exc.run_id and token_for(exc.run_id).is_set())
    except BaseException:
        return False
    return False


def make_episode_task(policy: RetryPolicy | None = None) -> Any:
    """The Prefect task. Built on demand so `import flows.episode` does not import prefect.

    No `timeout_seconds`: Prefect cannot interrupt a worker thread, and the episode
    enforces its own wall clock inside the loop.
    """
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    return task(  # type: ignore[call-overload]
        episode_body,
        name="episode",
        task_run_name="{spec.task.id}/{spec.mode}/{spec.sample_index}",
        retry_condition_fn=retry_infra_only,
        cache_policy=NO_CACHE,
        persist_result=False,
        log_prints=False,
        **(policy or RetryPolicy()).prefect_task_options(),
    )
