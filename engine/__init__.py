"""The run engine: "run these episodes" as a library call, with no orchestrator in it.

Every entry point runs episodes through here: `sandflow flows run` / `bench` (the
Prefect flow hands the engine Prefect's task runner), the rollout server's batches
(rl/batch.py), `sandflow run` (one episode) and any library caller::

    import engine
    result = engine.run(tasks, engine.build_run_spec(mode="sandbox", samples=4,
                                                     base_url="http://gpu:8000/v1", model="m",
                                                     warehouse="./wh"))
    result.summary["succeeded"], [o.answer for o in result.outcomes]

What it owns (one module each): planning and run ids (plan), the run from plan to
record (run; its lock, record, fan-out and end are one piece, `open_run` / `RunHandle`,
that the rollout server's batches and `sandflow run` go through too), fan-out (executors), retrying infrastructure failures only (retry),
cancellation (cancel), progress events (progress), bounds on live sandboxes and model
calls (slots), one attempt of one episode (episode), one interactive episode with its
trajectory.json (single). Defaults of an episode's limits have one home:
tasks.loop.DEFAULT_MAX_STEPS / DEFAULT_WALL_CLOCK_S (docs/episodes.md).
"""

from engine.cancel import CancelToken
from engine.episode import EpisodeOutcome
from engine.executors import Executor, ThreadExecutor, Work
from engine.plan import (
    MODES,
    EpisodeSpec,
    RunConfigError,
    RunLockedError,
    WarehouseFullError,
    new_run_id,
    plan,
)
from engine.retry import RETRYABLE, EpisodeCancelled, InfraFailure, RetryPolicy, is_retryable
from engine.run import RunHandle, RunResult, open_run, run
from tasks.spec import RunSpec, build_run_spec

__all__ = [
    "MODES",
    "RETRYABLE",
    "CancelToken",
    "EpisodeCancelled",
    "EpisodeOutcome",
    "EpisodeSpec",
    "Executor",
    "InfraFailure",
    "RetryPolicy",
    "RunConfigError",
    "RunHandle",
    "RunLockedError",
    "RunResult",
    "RunSpec",
    "ThreadExecutor",
    "WarehouseFullError",
    "Work",
    "build_run_spec",
    "is_retryable",
    "new_run_id",
    "open_run",
    "plan",
    "run",
]
