"""The run flow: the engine (engine/run.py) inside a Prefect flow.

The engine plans, resumes, preflights, records the run and fans out; this flow hands
it Prefect's task runner (flows/executor.py: one named Prefect task run per episode,
retries visible in the UI) and Prefect's global concurrency limits (flows/limits.py).
The task runner is the caller's choice: `run_flow.with_options(task_runner=
make_task_runner(...))(spec)`; the default is a thread pool of 4.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from engine import run as engine_run
from engine.plan import RunConfigError
from flows.episode import episode_body
from flows.executor import PrefectExecutor
from tasks.spec import RunSpec


def execute_run(spec: RunSpec) -> dict[str, Any]:
    """The body of the run flow (must run inside a Prefect flow: it submits tasks).

    Raises RunLockedError when another process runs this run id (`spec.wait_for_lock`:
    True waits for it, a number waits that many seconds).
    """
    if spec.warehouse is None:
        raise RunConfigError("a run needs a warehouse to record its episodes in (--warehouse)")
    result = engine_run(None, spec, executor=PrefectExecutor(), job=episode_body)
    return result.summary


def make_task_runner(kind: str = "thread", concurrency: int = 4, dask_address: str | None = None) -> Any:
    """ThreadPoolTaskRunner(max_workers=concurrency), or a DaskTaskRunner on a cluster."""
    if kind == "thread":
        return ThreadPoolTaskRunner(max_workers=concurrency)
    if kind == "dask":
        from prefect_dask import DaskTaskRunner

        if dask_address:
            return DaskTaskRunner(address=dask_address)
        import dask

        # in case dask was imported before flows set its environment (flows/prefect_env.py
        # says why); a Nanny hands its config to the worker process it starts
        dask.config.set({"distributed.worker.profile.enabled": False})
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": 2,
                "threads_per_worker": max(1, concurrency // 2),
                "host": "127.0.0.1",  # a throwaway local cluster: nothing listens beyond this host
                "dashboard_address": "127.0.0.1:0",
            }
        )
    raise RunConfigError(f"--task-runner {kind!r}: use 'thread' or 'dask'")


@flow(name="sandflow-run", log_prints=False, task_runner=ThreadPoolTaskRunner(max_workers=4))  # type: ignore[arg-type]
def run_flow(spec: RunSpec) -> dict[str, Any]:
    """Run a task set against a model in sandbox and/or LLM mode; resumable by run id.

    Everything about the run is in `spec` (tasks/spec.py). One process per run id: a
    second one raises RunLockedError naming the holder, or with `spec.wait_for_lock`
    waits for it (True: as long as it takes; seconds: that long).

    At the end the run's files are compacted (one file per table; `spec.compact=False`
    skips it); the summary's `compaction` says how long that took (inside `elapsed_s`).
    """
    return execute_run(spec)
