"""ONE Prefect task per episode (never per turn): its own wall clock, retries for infrastructure.

A model's own failure (no submit within max steps, context exhausted, its wall clock)
is a result: recorded and returned. An infrastructure failure (the sandbox or engine
broke, the endpoint kept failing: `sandbox_error`, `model_error`) is recorded too, then
raised as `InfraFailure` so Prefect retries the task; each attempt re-records the same
episode key, which the warehouse stores once (latest attempt wins). Ctrl+C is never
retried: the episode is recorded as interrupted and resume re-runs it.

Every episode of a run gets the same RunSpec (tasks/spec.py), which holds no secret:
Prefect stores task parameters. The API key is looked up in the process that runs the
episode (RunSpec.to_model_config -> tasks.model.api_key_from_env), a Dask worker included.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from datasets_prep.task import Task
from tasks.records import episode_key
from tasks.spec import RunSpec

RETRYABLE = frozenset({"sandbox_error", "model_error"})


class InfraFailure(RuntimeError):
    """The episode failed for infrastructure reasons; Prefect retries the task."""


class EpisodeCancelled(RuntimeError):
    """The run was interrupted (Ctrl+C): the episode stopped at a turn boundary or never
    started. Recorded as `interrupted` when it had started; never retried; resume re-runs it."""


# Set by the run flow on Ctrl+C. Worker threads never receive KeyboardInterrupt
# themselves, so each episode checks this flag after every model reply and tool call
# (through run_episode's event hook) and at its start.
_CANCEL = threading.Event()


def request_cancel() -> None:
    _CANCEL.set()


def reset_cancel() -> None:
    _CANCEL.clear()


def _stop_if_cancelled(kind: str, payload: Any) -> None:
    if kind != "end" and _CANCEL.is_set():
        raise KeyboardInterrupt  # run_episode records "interrupted" and closes the sandbox


class EpisodeSpec(BaseModel):
    """What one episode is: a task, a mode, a sample. Its key is stable across runs/resumes."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    run_id: str
    task: Task
    mode: str
    sample_index: int = 0

    @property
    def key(self) -> str:
        return episode_key(self.run_id, self.task.id, self.mode, self.sample_index)


@dataclass
class EpisodeOutcome:
    episode_id: str
    task_id: str
    mode: str
    sample_index: int
    termination: str | None
    error: str | None
    num_turns: int
    wall_s: float  # the episode's own clock (run_episode)
    body_start: float  # perf_counter at the task body's entry (same clock as body_end)
    body_end: float
    thread: str
    pid: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_writers: dict[tuple[str, str], Any] = {}
_writers_lock = threading.Lock()


def _writer(root: str, durability: str) -> Any:
    """One EpisodeWriter per warehouse root and process (it is thread-safe)."""
    from warehouse import Warehouse

    with _writers_lock:
        key = (str(Path(root).resolve()), durability)
        if key not in _writers:
            _writers[key] = Warehouse(root).writer(durability=durability)  # type: ignore[arg-type]
        return _writers[key]


def use_host_settings(run: RunSpec) -> None:
    """The sandbox settings the application handed the process that built the run, in the
    process that runs its episodes (a Dask worker has none of its own)."""
    if run.sandbox_host:
        from sandbox import settings

        settings.configure(settings.HostSettings(), **run.sandbox_host)


def run_one(spec: EpisodeSpec, run: RunSpec) -> EpisodeOutcome:
    """The task body, also callable without Prefect (benchmarks use it as the floor)."""
    from flows.limits import SANDBOX_GCL, shared_client, slot
    from tasks.loop import run_episode

    t0 = time.perf_counter()
    if run.warehouse is None:
        raise ValueError("RunSpec.warehouse is required to run an episode of a run")
    use_host_settings(run)
    model_cfg = run.to_model_config()
    client = shared_client(model_cfg, run.max_model_calls)
    recorder = _writer(run.warehouse, run.durability)
    needs_sandbox = spec.mode == "sandbox"
    max_sandboxes = run.max_sandboxes or run.concurrency
    with slot("sandbox", max_sandboxes if needs_sandbox else None, SANDBOX_GCL if needs_sandbox else None):
        result = run_episode(
            spec.task,
            model_cfg,
            run.to_sandbox_config(spec.run_id),
            recorder,
            mode=spec.mode,  # type: ignore[arg-type]
            sample_index=spec.sample_index,
            run_id=spec.run_id,
            limits=run.to_limits(),
            client=client,
            prompt_dir=run.prompt_dir,
            on_event=_stop_if_cancelled,
        )
    rec = result.record
    return EpisodeOutcome(
        episode_id=rec.episode_id,
        task_id=rec.task_id,
        mode=rec.mode,
        sample_index=rec.sample_index,
        termination=rec.termination,
        error=rec.error,
        num_turns=rec.num_turns,
        wall_s=rec.wall_s,
        body_start=t0,
        body_end=time.perf_counter(),
        thread=threading.current_thread().name,
        pid=os.getpid(),
    )


def retry_infra_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry_condition_fn: retry InfraFailure, nothing else, and nothing after Ctrl+C."""
    if _CANCEL.is_set():
        return False
    try:
        state.result()
    except InfraFailure:
        return True
    except BaseException:
        return False
    return False


def episode_body(spec: EpisodeSpec, run: RunSpec) -> dict[str, Any]:
    """Run, and turn an infrastructure termination into an exception Prefect retries."""
    from flows import progress

    if _CANCEL.is_set():
        raise EpisodeCancelled(f"episode {spec.key} not started: the run was interrupted")
    progress.started(spec.key)
    try:
        out = run_one(spec, run)
    except KeyboardInterrupt:
        raise EpisodeCancelled(f"episode {spec.key} stopped: the run was interrupted") from None
    if out.termination in RETRYABLE:
        progress.attempt_failed(spec.key)
        raise InfraFailure(f"episode {out.episode_id} ({spec.task.id}, {spec.mode}): {out.termination}: {out.error}")
    return out.as_dict()


def make_episode_task(retries: int = 2, retry_delay_s: float = 2.0) -> Any:
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
        retries=retries,
        retry_delay_seconds=retry_delay_s,
        retry_condition_fn=retry_infra_only,
        cache_policy=NO_CACHE,
        persist_result=False,
        log_prints=False,
    )
