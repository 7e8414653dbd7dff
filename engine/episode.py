"""One attempt of one episode of a run: the body every executor runs.

A model's own failure (no submit within max steps, context exhausted, its wall clock)
is a result: recorded and returned. An infrastructure failure (`engine.retry.RETRYABLE`)
is recorded too, then raised as `InfraFailure` so the executor retries it under the
run's RetryPolicy; each attempt re-records the same episode key, which the warehouse
stores once (latest attempt wins). A cancelled run is never retried: an episode not
started raises EpisodeCancelled, one in flight stops at its next step and is recorded
as interrupted, or budget_exhausted when the run's budget stopped it (engine.budget;
resume re-runs both).

Every value here is plain (a RunSpec, an EpisodeSpec): the body can run in another
process (a Dask worker). The API key is looked up in the process that runs the episode
(RunSpec.to_model_config -> tasks.model.api_key_from_env); so is the run's cancel token
(engine.cancel.token_for).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import progress
from engine.budget import RunBudget, budget_for
from engine.cancel import token_for
from engine.plan import EpisodeSpec
from engine.retry import EpisodeCancelled, InfraFailure, is_retryable
from engine.slots import SANDBOX_LIMIT, GlobalLimit, GlobalLimitUnavailable, shared_client, slot
from tasks.records import NullRecorder, Recorder, Spend
from tasks.spec import RunSpec


@dataclass
class EpisodeOutcome:
    """What an executor hands back for one episode (plain values: picklable)."""

    episode_id: str
    task_id: str
    mode: str
    sample_index: int
    termination: str | None
    error: str | None
    answer: str | None
    num_turns: int
    wall_s: float  # the episode's own clock (run_episode)
    body_start: float  # perf_counter at the body's entry (same clock as body_end)
    body_end: float
    thread: str
    pid: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_writers: dict[tuple[str, str], Any] = {}
_writers_lock = threading.Lock()


def _writer(root: str | None, durability: str) -> Recorder:
    """One EpisodeWriter per warehouse root and process (it is thread-safe)."""
    if root is None:
        return NullRecorder()
    from warehouse import Warehouse

    with _writers_lock:
        key = (str(Path(root).resolve()), durability)
        if key not in _writers:
            _writers[key] = Warehouse(root).writer(durability=durability)  # type: ignore[arg-type]
        return _writers[key]


def run_one(
    spec: EpisodeSpec, run: RunSpec, global_limit: GlobalLimit | None = None
) -> EpisodeOutcome:
    """One attempt, recorded; never raises for the model's or the sandbox's failures
    (benchmarks use it as the floor under any executor)."""
    t0 = time.perf_counter()
    model_cfg = run.to_model_config()
    client = shared_client(model_cfg, run.fanout.max_model_calls, global_limit)
    needs_sandbox = spec.mode == "sandbox"
    max_sandboxes = run.fanout.max_sandboxes or run.fanout.concurrency
    limit = max_sandboxes if needs_sandbox else None
    budget = budget_for(run)
    prior = paid_before(spec)
    with slot("sandbox", limit, SANDBOX_LIMIT if needs_sandbox else None, None, global_limit):
        try:
            result = _run_episode(spec, run, model_cfg, client, budget, prior)
        finally:
            if budget is not None:
                budget.episode_ended(spec.key)
    rec = result.record
    own = [t for t in result.turns if rec.branch_turn is None or t.turn_index >= rec.branch_turn]
    _remember_paid(spec, (prior or Spend()).plus_turns(own))
    return EpisodeOutcome(
        episode_id=rec.episode_id,
        task_id=rec.task_id,
        mode=rec.mode,
        sample_index=rec.sample_index,
        termination=rec.termination,
        error=rec.error,
        answer=rec.answer,
        num_turns=rec.num_turns,
        wall_s=rec.wall_s,
        body_start=t0,
        body_end=time.perf_counter(),
        thread=threading.current_thread().name,
        pid=os.getpid(),
    )


def _run_episode(
    spec: EpisodeSpec,
    run: RunSpec,
    model_cfg: Any,
    client: Any,
    budget: RunBudget | None,
    prior: Spend | None = None,
) -> Any:
    """tasks.loop.run_episode with the run's values; the budget counts its replies (and
    what the attempts it replaces paid: `prior`, carried on in its record)."""
    from tasks.loop import run_episode

    recorder = _writer(run.recording.warehouse, run.recording.durability)
    if prior is not None:
        recorder = _Carrying(recorder, prior)
    if budget is not None:
        budget.attempt_started(spec.key, prior)
    return run_episode(
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
        cancel=token_for(spec.run_id),
        on_event=budget.hook(spec.key) if budget is not None else None,
    )


# What every attempt of an episode run in this process paid (key: run id, episode key),
# its predecessors' included: the next attempt's `replaced`. Seeded per run from the
# warehouse (EpisodeSpec.replaced) and forgotten when a run starts (engine.run).
_paid: dict[tuple[str, str], Spend] = {}
_paid_lock = threading.Lock()


def paid_before(spec: EpisodeSpec) -> Spend | None:
    """What the attempts of `spec`'s episode before this one paid (None: it has none)."""
    with _paid_lock:
        here = _paid.get((spec.run_id, spec.key))
    return here if here is not None else spec.replaced


def _remember_paid(spec: EpisodeSpec, spend: Spend) -> None:
    with _paid_lock:
        _paid[(spec.run_id, spec.key)] = spend


def forget_paid(run_id: str) -> None:
    """A run starts: what it paid is read from the warehouse again (EpisodeSpec.replaced)."""
    with _paid_lock:
        for k in [k for k in _paid if k[0] == run_id]:
            del _paid[k]


class _Carrying:
    """A recorder that writes `replaced` into the episode's record (its start and its
    end), so the attempt's row says what the attempts it replaces paid."""

    def __init__(self, inner: Recorder, replaced: Spend) -> None:
        self.inner = inner
        self.replaced = replaced

    def start_episode(self, episode: Any) -> None:
        episode.replaced = self.replaced
        self.inner.start_episode(episode)

    def record_turn(self, turn: Any) -> None:
        self.inner.record_turn(turn)

    def finish_episode(self, episode: Any) -> None:
        episode.replaced = self.replaced
        self.inner.finish_episode(episode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def use_host_settings(run: RunSpec) -> None:
    """The sandbox settings the application handed the process that built the run, in the
    process that runs its episodes (a Dask worker has none of its own)."""
    if run.sandbox.host:
        from sandbox import settings

        settings.configure(settings.HostSettings(), **run.sandbox.host)


def attempt(spec: EpisodeSpec, run: RunSpec, global_limit: GlobalLimit | None = None) -> dict[str, Any]:
    """The executors' job: one attempt; InfraFailure when it is worth another,
    EpisodeCancelled when the run was cancelled (before or during the episode)."""
    use_host_settings(run)
    budget = budget_for(run)  # first: a resume with a higher budget renews a spent token
    token = token_for(spec.run_id)
    if budget is not None and not token.is_set():
        budget.refresh_if_due()  # what every process (Dask workers) spent: the warehouse's count
    if token.is_set():
        raise EpisodeCancelled(f"episode {spec.key} not started: {token.reason or 'the run was cancelled'}")
    progress.started(spec.key)
    try:
        out = run_one(spec, run, global_limit)
    except GlobalLimitUnavailable as exc:  # the orchestrator's hiccup: no episode started
        progress.attempt_failed(spec.key)
        raise InfraFailure(
            f"episode {spec.key} ({spec.task.id}, {spec.mode}): not started: {exc}", run_id=spec.run_id
        ) from None
    if out.termination in ("interrupted", "budget_exhausted") and token.is_set():
        raise EpisodeCancelled(f"episode {spec.key} stopped: {token.reason or 'the run was cancelled'}")
    if is_retryable(out.termination):
        progress.attempt_failed(spec.key)
        raise InfraFailure(
            f"episode {out.episode_id} ({spec.task.id}, {spec.mode}): {out.termination}: {out.error}",
            out.as_dict(),
            run_id=spec.run_id,
        )
    return out.as_dict()
