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

    Raises RunLockedError when another process runs this run id (`spec.recording.wait_for_lock`:
    True waits for it, a number waits that many seconds).
    """
    if spec.recording.warehouse is None:
        raise RunConfigError("a run needs a warehouse to record its episodes in (--warehouse)")
    result = engine_run(None, spec, executor=PrefectExecutor(), job=episode_body)
    return result.summary


TASK_RUNNERS = ("thread", "dask", "ray")
RAY_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # episodes pass small values; Ray's default is 30% of RAM


def make_task_runner(kind: str = "thread", concurrency: int = 4, dask_address: str | None = None) -> Any:
    """ThreadPoolTaskRunner(max_workers=concurrency), a DaskTaskRunner on a cluster, or a
    RayTaskRunner (the optional extra `ray`)."""
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
    if kind == "ray":
        return _ray_task_runner(concurrency)
    raise RunConfigError(f"--task-runner {kind!r}: use 'thread', 'dask' or 'ray'")


def _ray_task_runner(concurrency: int) -> Any:
    """A local Ray instance started for the run with one CPU slot per episode at once (Ray
    runs a task per CPU it is told of; episodes wait on a model and a sandbox, not on this
    host's cores), no dashboard and a small object store; RAY_ADDRESS joins a Ray cluster
    instead (ray.init reads it)."""
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise RunConfigError(
            "--task-runner ray needs Prefect's Ray task runner, an optional extra: "
            "pip install -e '.[ray]' (or bash scripts/setup.sh --ray)"
        ) from None
    import os

    if os.environ.get("RAY_ADDRESS"):
        return RayTaskRunner(address=os.environ["RAY_ADDRESS"])
    init_kwargs: dict[str, Any] = {
        "num_cpus": max(1, concurrency),
        "include_dashboard": False,
        "object_store_memory": RAY_OBJECT_STORE_BYTES,
        "log_to_driver": False,
    }
    temp_dir = ray_temp_dir()
    if temp_dir is not None:
        init_kwargs["_temp_dir"] = temp_dir
    return RayTaskRunner(init_kwargs=init_kwargs)


# What Ray adds to its temp dir for a socket: /session_<date>_<time>_<us>_<pid>/sockets/
# plasma_store (+ a counter), 67 bytes at most; a unix socket's path holds 107.
RAY_SOCKET_TAIL = 67
SUN_PATH_MAX = 107


def ray_temp_dir() -> str | None:
    """A short temp dir for a local Ray instance when its default is too long, else None.

    Ray puts its sockets under RAY_TMPDIR, else TMPDIR, else /tmp (+ /ray): on a cluster
    whose TMPDIR is long (/scratch/slurm/job-123456/...) they pass the 107 bytes of a unix
    socket's path and Ray cannot start. Then this user's /tmp/sandflow-ray-<uid> (made
    here; one of ours, never another user's, else a fresh mkdtemp), which Ray fills and
    keeps as it keeps /tmp/ray (its logs, session_latest)."""
    import os
    import stat
    import tempfile

    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    if len(os.fsencode(os.path.join(base, "ray"))) + RAY_SOCKET_TAIL <= SUN_PATH_MAX:
        return None
    mine = f"/tmp/sandflow-ray-{os.getuid()}"
    try:
        os.mkdir(mine, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return tempfile.mkdtemp(prefix="sandflow-ray-", dir="/tmp")
    st = os.lstat(mine)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # another user's, or a link
        return tempfile.mkdtemp(prefix="sandflow-ray-", dir="/tmp")
    return mine


@flow(name="sandflow-run", log_prints=False, task_runner=ThreadPoolTaskRunner(max_workers=4))  # type: ignore[arg-type]
def run_flow(spec: RunSpec) -> dict[str, Any]:
    """Run a task set against a model in sandbox and/or LLM mode; resumable by run id.

    Everything about the run is in `spec` (tasks/spec.py). One process per run id: a
    second one raises RunLockedError naming the holder, or with `spec.recording.wait_for_lock`
    waits for it (True: as long as it takes; seconds: that long).

    At the end the run's files are compacted (one file per table; `spec.compact=False`
    skips it); the summary's `compaction` says how long that took (inside `elapsed_s`).
    """
    return execute_run(spec)
