"""A run from plan to record: the engine under every entry point.

    plan      tasks x modes x samples, each episode with a stable key (engine.plan)
    resume    keys the warehouse already holds with a model result are skipped
    preflight the sandbox image (sandbox episodes only) and the model endpoint, before
              anything is recorded or started; the embedded model is started when no
              endpoint is given (and stopped at the end)
    record    the run's row: `running` while this process handles it, then `finished`,
              `failed` (episodes failed after their retries), `budget_exhausted` or
              `interrupted` (a cancel, Ctrl+C, an error): never left `running` by a
              process that stopped handling it
    fan out   through an Executor (engine.executors): threads here, or Prefect's task
              runner (flows/), with ONE retry policy (engine.retry) and ONE cancel token
              (engine.cancel) that every layer checks
    report    progress events (engine.progress) as episodes start and end; the summary

The lock, the record, the fan-out and the end are one piece, `open_run` and its
`RunHandle`, that every writer of a run goes through: `run` here, the rollout server's
batches (rl/batch.py: each episode streamed as it ends, the lock held while the stream
lasts) and `sandflow run`'s one episode (engine.single)::

    with open_run(wh, run_id, token) as handle:     # the lock; the end recorded on exit
        handle.record(model=..., config=...)        # `running`
        for ep, result in handle.fan_out(executor, job, episodes, policy=..., budget=spec):
            ...                                     # each episode as it ends
        handle.finish()                             # finished / failed / budget_exhausted

Nothing here records twice: an episode key is written by its episode only, and the
warehouse keeps one (the latest) recording per key. A run interrupted in any way (Ctrl+C,
kill -9, a lost machine) is resumed by running again with the same run id. One process
per run id: the warehouse's run lock.

    from engine import run, RunSpec
    result = run(tasks, build_run_spec(mode="sandbox", samples=4, base_url=..., warehouse=...))
    result.outcomes  # one EpisodeOutcome per episode that ran
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets_prep.task import Task, TaskSet
from engine import budget as budgets
from engine import progress
from engine.cancel import CancelToken, registered
from engine.episode import EpisodeOutcome, attempt, forget_paid
from engine.executors import Executor, Finished, ThreadExecutor, Work
from engine.plan import (
    MODES,
    EpisodeSpec,
    RunConfigError,
    RunLockedError,
    WarehouseFullError,
    new_run_id,
    plan,
)
from engine.retry import EpisodeCancelled, InfraFailure, RetryPolicy
from engine.slots import GlobalLimit
from tasks.spec import RunSpec

log = logging.getLogger("sandflow.engine")


@dataclass
class RunResult:
    """What `run` hands back: the summary (JSON-safe) and every episode's outcome."""

    summary: dict[str, Any]
    outcomes: list[EpisodeOutcome] = field(default_factory=list)
    failures: list[tuple[EpisodeSpec, BaseException]] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return str(self.summary["run_id"])

    @property
    def all_failed(self) -> bool:
        """Episodes ran and not one of them ended with a model result."""
        return bool(self.summary["ran"]) and not self.summary["succeeded"]


def no_space(exc: BaseException | None) -> bool:
    """True when `exc` (or what caused it) is ENOSPC / EDQUOT (chaos: warehouse disk full)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@contextlib.contextmanager
def hold_run(wh: Any, run_id: str, wait: bool | float = False) -> Iterator[None]:
    """The run's lock (Warehouse.hold_run, warehouse/runlock.py) for the block, with
    what a killed writer of the run left half-written removed first;
    RunLockedError (one sentence naming the holder) if another process holds it.

    Every writer of a run takes it, before its record says `running` and until after it
    says how the run ended: engine.run, the rollout server's batches (rl/server.py),
    `sandflow run`. Readers then tell a live run from one whose process died (kill -9,
    OOM): `running` with its lock free reads `interrupted` (the `abandoned` column)."""
    from warehouse import RunLocked

    try:
        lock = wh.hold_run(run_id, wait=wait)
        lock.__enter__()
    except RunLocked as exc:
        raise RunLockedError(str(exc)) from None
    try:
        # Half-written temporary files a killed writer of this run left (invisible, on disk).
        wh.remove_dead_temps(run_id)
        yield
    finally:
        lock.__exit__(None, None, None)


class RunHandle:
    """One run from its record `running` to its end, the piece every writer of a run goes
    through: `engine.run`, the rollout server's batches (rl/batch.py) and `sandflow run`
    (engine.single). Made by `open_run`, under the run's lock.

        record(...)   the run's row says `running` (wh.write_run's fields)
        fan_out(...)  the episodes through an executor with ONE retry policy and the run's
                      ONE cancel token (and its budget, engine.budget), each (episode,
                      result) handed to the caller as it ends; counted here
        ran_here(...) or the episodes the caller ran itself (`sandflow run`, engine.single)
        finish()      the run's row leaves `running`, once, whoever calls first: `_status`
                      of how its episodes ended when every one was handed back and taken,
                      `interrupted` otherwise (an error, Ctrl+C, a consumer that stopped)

    Without a warehouse (wh None) nothing is recorded; the rest is the same.
    """

    def __init__(self, wh: Any, run_id: str, token: CancelToken, root: str | None = None) -> None:
        self.wh, self.run_id, self.token = wh, run_id, token
        self.root = root if root is not None else (str(wh.root) if wh is not None else None)
        self.succeeded = 0
        self.cancelled = 0
        self.failed: list[tuple[EpisodeSpec, BaseException]] = []
        self.budget: budgets.RunBudget | None = None
        self.status: str | None = None  # set once the run's end is decided (finish)
        self._recorded = False
        self._complete = False  # every episode handed back and taken by the caller
        self._lock = threading.Lock()

    def record(self, **fields: Any) -> None:
        """The run's row says `running` from now until `finish`."""
        if self.wh is not None:
            self.wh.write_run(self.run_id, status="running", **fields)
        self._recorded = True

    def fan_out(
        self,
        executor: Executor,
        job: Callable[..., Any],
        episodes: list[EpisodeSpec],
        args: tuple[Any, ...] = (),
        *,
        policy: RetryPolicy,
        budget: RunSpec | None = None,
    ) -> Generator[Finished, None, None]:
        """`job(episode, *args)` for every episode through `executor` under `policy` and
        the run's token: each (episode, outcome or the exception it ended with) as it ends.

        budget: the RunSpec whose budget (max_cost_usd / max_run_tokens) bounds the run (checked
        against the warehouse before any episode starts: a spent one starts none).
        A full warehouse disk stops the run (WarehouseFullError, resume finishes it). A
        caller that stops taking (an error, Ctrl+C, close()) cancels the run's token; the
        episodes in flight stop at their next step and are waited for here."""
        with registered(self.run_id, self.token):
            try:
                if budget is not None:  # reached already (a resume with the same budget): nothing starts
                    self.budget = budgets.start(budget, self.token)
                results = executor.map(Work(job, episodes, args, policy, self.token))
                try:
                    for ep, res in results:
                        self._count(ep, res)
                        yield ep, res
                    self._complete = True
                finally:
                    close = getattr(results, "close", None)
                    if close is not None:
                        close()  # an executor stopped early waits for its episodes here
            except BaseException:
                self.token.cancel("the run was interrupted")
                raise
            finally:
                budgets.stop(self.run_id, self.budget)

    def ran_here(self, finished: list[Finished]) -> None:
        """Every episode of the run, run by the caller in its own thread (`sandflow run`'s
        one episode: its live view and Ctrl+C inside the episode), counted as `fan_out`
        counts them: `finish` then applies the same rules."""
        for ep, res in finished:
            self._count(ep, res)
        self._complete = True

    def _count(self, ep: EpisodeSpec, res: Any) -> None:
        """One episode's end: counted for the run's status, told to progress listeners."""
        if isinstance(res, EpisodeCancelled):
            self.cancelled += 1
            progress.finished(ep.key, ok=False, termination="interrupted")
        elif isinstance(res, BaseException):
            if no_space(res):  # stop: queued episodes are cancelled, resume finishes them
                self.token.cancel("the warehouse is out of space")
                raise WarehouseFullError(
                    f"the warehouse {self.root} is out of space ({res}); {self.succeeded} "
                    f"episode(s) were recorded before it. Free space there, then "
                    f"resume with --run-id {self.run_id}"
                ) from None
            self.failed.append((ep, res))
            progress.finished(ep.key, ok=False, termination="failed")
        else:
            self.succeeded += 1
            progress.finished(ep.key, ok=True, termination=_termination(res))

    def finish(self) -> str:
        """The run's end: decided once (later calls return it), recorded when the run was."""
        with self._lock:
            if self.status is not None:
                return self.status
            self.status = _status(self.token, self.failed) if self._complete else "interrupted"
        if self._recorded and self.wh is not None:
            _finish(self.wh, self.run_id, self.status, self.failed, self.cancelled, self.token)
        return self.status


@contextlib.contextmanager
def open_run(
    wh: Any, run_id: str, token: CancelToken, *, wait: bool | float = False, root: str | None = None
) -> Iterator[RunHandle]:
    """The run's lock (`hold_run`; none without a warehouse) and its handle for the block;
    whatever ends the block, the run's record leaves `running` (RunHandle.finish) before
    the lock is released, and an error cancels the run's token.

    Held across threads too: the rollout server enters it for a batch when the request
    comes and closes it once the stream has ended (rl/batch.py)."""
    held = hold_run(wh, run_id, wait=wait) if wh is not None else contextlib.nullcontext()
    with held:
        handle = RunHandle(wh, run_id, token, root)
        try:
            yield handle
        except BaseException:
            # decided before the cancel: a run whose every episode was told (ran_here, a
            # fan-out taken to its end) ends by how they ended, any other `interrupted`
            handle.finish()
            token.cancel("the run was interrupted")
            raise
        finally:
            handle.finish()


def _termination(res: Any) -> str | None:
    """How an episode a job handed back ended, when it says (an EpisodeOutcome, its dict)."""
    if isinstance(res, dict):
        return res.get("termination")
    return getattr(res, "termination", None)


def orchestration_overhead(outcomes: list[dict[str, Any]]) -> dict[str, float | None]:
    """The executor's own cost per episode, measured from the episode bodies' clocks.

    All episodes are submitted at once, so a worker thread is never idle while work is
    queued: the gap between one body's end and the next body's start on the same thread
    is what the executor spent finishing one episode and starting the next (for Prefect:
    state changes, events, API calls). Its mean over the body's mean is the overhead.
    """
    by_thread: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for o in outcomes:
        by_thread[(o["pid"], o["thread"])].append(o)
    gaps: list[float] = []
    for items in by_thread.values():
        items.sort(key=lambda o: o["body_start"])
        for a, b in zip(items, items[1:], strict=False):
            gaps.append(max(0.0, b["body_start"] - a["body_end"]))
    bodies = [o["body_end"] - o["body_start"] for o in outcomes]
    if not bodies:
        return {"gap_s_mean": None, "body_s_mean": None, "overhead_frac": None}
    body_mean = sum(bodies) / len(bodies)
    gap_mean = sum(gaps) / len(gaps) if gaps else None
    return {
        "gap_s_mean": gap_mean,
        "body_s_mean": body_mean,
        "overhead_frac": (gap_mean / body_mean) if gap_mean is not None and body_mean > 0 else None,
    }


def compact_after_run(root: str, run_id: str) -> dict[str, Any]:
    """Merge the run's per-episode files once its episodes are done (warehouse.compact).

    Why here: a query over thousands of per-episode files is 10-50x slower than over one
    file. Safe with resume (a re-run episode writes a new file that wins over the compacted
    copy; the next run's compaction merges it) and with open readers (they keep their
    snapshot; the merged inputs are deleted once no session is open, waited for briefly).
    A failure here never fails the run: its episodes are recorded either way, and the
    error is reported.
    """
    from warehouse import Warehouse

    t0 = time.perf_counter()
    try:
        res = Warehouse(root).compact(run_id, settle_s=2.0)
    except Exception as exc:
        log.warning("compaction of run %s failed: %s", run_id, exc)
        return {"seconds": time.perf_counter() - t0, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "seconds": time.perf_counter() - t0,
        "files_before": res.files_before,
        "rows_after": res.rows_after,
        "skipped_bad": [str(b) for b in res.skipped_bad],
        # > 0: merged files kept (hidden) for an open reader; `sandflow warehouse compact` removes them
        "pending_deletes": res.pending_deletes,
    }


def check_image(backend: str, image: str | None) -> str | None:
    """Fail before fanning out when the engine or the sandbox image is missing (one sentence)."""
    from sandbox.backends import capabilities

    if not capabilities(backend).image:
        return image
    from sandbox.base import SandboxError
    from sandbox.engine import docker_client, ensure_image
    from sandbox.image import DEFAULT_SPEC

    tag = image or DEFAULT_SPEC.tag
    try:
        ensure_image(docker_client(), tag)
    except SandboxError as exc:
        raise RunConfigError(f"{exc} (--mode llm needs no sandbox)") from None
    return tag


def _image_id(backend: str, tag: str | None) -> str | None:
    """The engine's id of the sandbox image (lineage: a rebuilt image under one tag)."""
    from sandbox.backends import capabilities

    if not tag or not capabilities(backend).image:
        return None
    try:
        from sandbox.engine import docker_client

        return str(docker_client().images.get(tag).id)
    except Exception:  # lineage is informative: never fail a run for it
        return None


def preflight_model(cfg: Any, model_given: bool) -> Any:
    """tasks.model.preflight, its errors as RunConfigError (one sentence, no traceback)."""
    from tasks.model import EndpointUnreachable, ModelError, preflight

    try:
        return preflight(cfg, model_given=model_given)
    except EndpointUnreachable as exc:
        raise RunConfigError(
            f"cannot reach the model server at {exc.base_url}: it does not answer "
            "(is it running? check --base-url)"
        ) from None
    except ModelError as exc:
        raise RunConfigError(str(exc)) from None


def _prewarm(spec: RunSpec, pending: list[EpisodeSpec], executor: Executor) -> None:
    """Start the warm pool's first sandboxes (one per concurrent sandbox episode) now.

    Why: they start while the run still checks its endpoint and writes its run record,
    and all together (the pool paces bigger bursts), instead of one by one as the first
    episodes ask. Only when episodes run in this process: a Dask worker keeps its own pool.
    """
    n = sum(1 for s in pending if s.mode == "sandbox")
    if not n or spec.sandbox.reuse != "pool" or not executor.in_process:
        return
    from sandbox import prewarm

    prewarm(spec.to_sandbox_config(spec.run_id), min(n, spec.fanout.max_sandboxes or spec.fanout.concurrency))


def resolve_taskset(spec: RunSpec, tasks: list[Task] | TaskSet | None) -> TaskSet:
    """The tasks given, as a TaskSet (named after spec.task_set), or spec.task_set loaded."""
    if tasks is None:
        from datasets_prep.prepare import load_taskset

        return load_taskset(spec.task_set)
    if isinstance(tasks, TaskSet):
        return tasks
    return TaskSet.build(tasks, name=spec.task_set or "tasks", source="engine.run")


def run(
    tasks: list[Task] | TaskSet | None,
    spec: RunSpec,
    *,
    executor: Executor | None = None,
    cancel: CancelToken | None = None,
    global_limit: GlobalLimit | None = None,
    job: Callable[..., Any] = attempt,
) -> RunResult:
    """Run `tasks` (None: load `spec.task_set`) as `spec` describes; see the module docstring.

    executor: how episodes fan out (default: a thread pool of `spec.fanout.concurrency`).
    cancel: the run's token; cancel it from any thread to stop the run (episodes not
        started never start, running ones stop at their next step, recorded interrupted).
        Ctrl+C (KeyboardInterrupt in the consuming thread) cancels it too, then re-raises.
    global_limit: cross-process bounds on sandboxes and model calls (engine.slots).

    Raises RunConfigError (a bad parameter, a missing image, an unreachable endpoint),
    RunLockedError (another process runs this run id; `spec.recording.wait_for_lock` waits),
    WarehouseFullError (the warehouse's disk filled up: the run stops).
    """
    t_start = time.perf_counter()
    if spec.fanout.concurrency < 1:
        raise RunConfigError(f"--concurrency {spec.fanout.concurrency}: must be at least 1")
    if not spec.endpoint.base_url and spec.fanout.max_model_calls is None:
        # The embedded llama.cpp server answers one request at a time: queueing requests
        # in its socket only makes them time out; queue them here instead.
        spec = spec.replace(max_model_calls=1)
    ts = resolve_taskset(spec, tasks)
    rid = spec.run_id or new_run_id(ts.name)
    episodes = plan(list(ts.tasks), rid, spec.mode, spec.samples)
    executor = executor or ThreadExecutor(spec.fanout.concurrency)
    token = cancel or CancelToken()
    wh, root = None, None
    if spec.recording.warehouse is not None:
        from warehouse import Warehouse

        root = str(Path(spec.recording.warehouse).expanduser())
        wh = Warehouse(root)
    # One run id, one writer (warehouse.runlock): a second process on this run id is
    # refused (or waits), and a kill -9'd holder releases the lock with its death.
    with open_run(wh, rid, token, wait=spec.recording.wait_for_lock, root=root) as handle:
        # The run keeps the exact tasks it ran (warehouse.tasksets): a resumed run goes on
        # with those, even if its source gives other tasks today.
        ran = wh.run_tasks(rid) if wh is not None else None
        if wh is not None and ran is None:
            wh.keep_tasks(rid, ts.tasks, name=ts.name)
        elif ran is not None and ran.content_hash != ts.content_hash:
            ts = ran.model_copy(update={"name": ts.name})
            episodes = plan(list(ts.tasks), rid, spec.mode, spec.samples)
        return _execute(spec, ts, episodes, handle, executor, global_limit, job, t_start)


def _run_config(spec: RunSpec, live_cfg: Any) -> dict[str, Any]:
    """What the run's record says about how it ran (no secret)."""
    return {
        "mode": spec.mode,
        "samples": spec.samples,
        "concurrency": spec.fanout.concurrency,
        "max_sandboxes": spec.fanout.max_sandboxes,
        "max_model_calls": spec.fanout.max_model_calls,
        "limits": spec.to_limits().model_dump(),
        "model": live_cfg.public_dict(),
        "backend": spec.sandbox.backend,
        "network": spec.sandbox.network,
        "sandbox_reuse": spec.sandbox.reuse,
        "durability": spec.recording.durability,
        "task_set": spec.task_set,
        # the prompt set (a name or a folder; None: the built-in one): it picks the tools too,
        # so a series' report says when it changed (warehouse/series.py, prompts_changed)
        "prompts": spec.prompt_dir,
        "retries": spec.fanout.retries,
        # the run's budget (engine.budget); a resume may raise it
        "max_cost_usd": spec.budget.max_cost_usd,
        "max_run_tokens": spec.budget.max_run_tokens,
        # what the run's tokens cost (warehouse/cost.py); {}: unknown
        "prices": spec.budget.prices,
    }


def _execute(
    spec: RunSpec,
    ts: TaskSet,
    episodes: list[EpisodeSpec],
    handle: RunHandle,
    executor: Executor,
    global_limit: GlobalLimit | None,
    job: Callable[..., Any],
    t_start: float,
) -> RunResult:
    """`run`'s work once the run's lock is held (no lock without a warehouse)."""
    from tasks.local_model import endpoint

    wh, rid, root, token = handle.wh, handle.run_id, handle.root, handle.token
    done = wh.done_keys(rid) if wh is not None else set()
    pending = [s for s in episodes if (s.task.id, s.mode, s.sample_index) not in done]
    progress.planned(total=len(pending), skipped=len(episodes) - len(pending), run_id=rid)
    image = spec.sandbox.image
    if "sandbox" in MODES[spec.mode] and pending:
        image = check_image(spec.sandbox.backend, spec.sandbox.image)
    spec = spec.replace(run_id=rid, warehouse=root, image=image)
    _prewarm(spec, pending, executor)
    previous = wh.run_info(rid) if wh is not None else None
    pending = _carry_paid(wh, rid, pending, resumed=previous is not None)
    outcomes: list[EpisodeOutcome] = []
    with endpoint(spec.to_model_config()) as live_cfg:
        if pending:
            live_cfg = preflight_model(live_cfg, model_given=bool(spec.endpoint.model) or not spec.endpoint.base_url)
        # What every episode gets: the resolved spec (the embedded model's address, the model
        # name the server serves), without a key (each process looks its own up).
        spec = spec.replace(base_url=live_cfg.base_url, model=live_cfg.model)
        if pending:  # --max-cost without a price: refused before anything is recorded
            budgets.check_priced(spec)
        handle.record(
            model=live_cfg.model,
            image=image,
            dataset=ts.name,
            dataset_hash=ts.content_hash,
            config=_run_config(spec, live_cfg),
            started_at=(previous or {}).get("started_at"),
            series=spec.recording.series or (previous or {}).get("series"),
            image_id=(_image_id(spec.sandbox.backend, image) if wh is not None and "sandbox" in MODES[spec.mode] else None)
            or (previous or {}).get("image_id"),
        )
        args = (spec,) if global_limit is None else (spec, global_limit)
        policy = RetryPolicy(retries=spec.fanout.retries)
        with contextlib.closing(handle.fan_out(executor, job, pending, args, policy=policy, budget=spec)) as results:
            for _ep, res in results:
                if not isinstance(res, BaseException):
                    outcomes.append(res if isinstance(res, EpisodeOutcome) else EpisodeOutcome(**res))
        status = handle.finish()
    compaction = (
        compact_after_run(root, rid) if spec.recording.compact and root is not None and Path(root).is_dir() else None
    )
    elapsed = time.perf_counter() - t_start  # compaction included: the run's own end
    dicts = [o.as_dict() for o in outcomes]
    failures = [_failure_line(ep, exc) for ep, exc in handle.failed]
    summary = {
        "run_id": rid,
        "status": status,
        "task_set": ts.name,
        "task_set_hash": ts.content_hash,
        "model": live_cfg.model,
        "warehouse": root,
        "planned": len(episodes),
        "skipped": len(episodes) - len(pending),
        "ran": len(pending),
        "succeeded": len(outcomes),
        "failed": len(handle.failed),
        "cancelled": handle.cancelled,
        "cancel_reason": token.reason,
        # {max_cost_usd, max_run_tokens, spent_tokens, spent_usd, exhausted}; None: no budget
        "budget": handle.budget.summary() if handle.budget is not None else None,
        "failures": failures[:20],
        "terminations": dict(Counter(str(o.termination) for o in outcomes)),
        "elapsed_s": elapsed,
        "episodes_per_s": (len(outcomes) / elapsed) if elapsed > 0 else None,
        "prefect": orchestration_overhead(dicts),  # the executor's overhead (key kept for readers)
        "compaction": compaction,
        "pid": os.getpid(),
        "worker_pids": sorted({o.pid for o in outcomes}),
    }
    return RunResult(summary, outcomes, handle.failed)


def _carry_paid(wh: Any, rid: str, pending: list[EpisodeSpec], *, resumed: bool) -> list[EpisodeSpec]:
    """`pending` with what each one's recorded attempts paid (EpisodeSpec.replaced): the
    re-run carries it on in its record, so the money stays counted against the run when
    its attempt is replaced (a budget stopped, an infrastructure failure). One aggregate,
    only when the run has a record (a resume)."""
    forget_paid(rid)
    if wh is None or not pending or not resumed:
        return pending
    from warehouse.cost import paid_by_episode

    with wh.query(run_id=rid, tables=("episodes", "turns")) as q:
        paid = paid_by_episode(q, rid)
    return [s.model_copy(update={"replaced": paid[s.key]}) if s.key in paid else s for s in pending]


def _status(token: CancelToken, failed: list[Any]) -> str:
    """The run's status once its episodes are done: `budget_exhausted` when its budget
    stopped it (resume with a higher one finishes it)."""
    if token.is_set():
        return "budget_exhausted" if token.termination == budgets.TERMINATION else "interrupted"
    return "failed" if failed else "finished"


def _failure_line(ep: EpisodeSpec, exc: BaseException) -> str:
    if isinstance(exc, InfraFailure):
        return f"{ep.label}: {exc}"
    return f"{ep.label}: {type(exc).__name__}: {exc}"


def _finish(
    wh: Any,
    rid: str,
    status: str,
    failed: list[tuple[EpisodeSpec, BaseException]],
    cancelled: int,
    token: CancelToken,
) -> None:
    """The run's record leaves `running` whatever happened above."""
    notes = []
    if failed:
        notes.append(f"{len(failed)} episodes failed")
    if token.is_set() and status == "budget_exhausted":
        notes.append(f"budget: {token.reason}" + (f" ({cancelled} episodes stopped or not run)" if cancelled else ""))
    elif token.is_set():
        notes.append(f"cancelled: {token.reason}" + (f" ({cancelled} episodes not run)" if cancelled else ""))
    try:
        wh.finish_run(rid, status=status, notes="; ".join(notes) or None)
    except OSError as exc:  # a full disk must not hide the error above; resume rewrites it
        if not no_space(exc):
            raise
