"""The run flow: a task set x a model x a mode x samples -> episodes, fanned out.

    plan    every (task, mode, sample) of the set gets a stable episode key
    resume  keys the warehouse already holds with a model result are skipped
    fan out one Prefect task per remaining episode, on the flow's task runner
            (ThreadPoolTaskRunner(max_workers=concurrency) by default, a Dask
            cluster with --task-runner dask), live sandboxes and model calls
            bounded separately (flows/limits.py)
    collect as futures resolve: progress, failures after retries, the summary

Nothing here records twice: an episode key is written by its task only, and the
warehouse keeps one (the latest) recording per key. A run interrupted in any way
(Ctrl+C, kill -9, a lost machine) is resumed by running again with the same run id.
Containers never outlive their episode: the sandbox closes them on every exit path,
and `sandflow sandbox gc` removes what a kill -9 left, by label.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.episode import EpisodeSpec
from tasks.spec import RunSpec

MODES = {"sandbox": ("sandbox",), "llm": ("llm",), "both": ("sandbox", "llm")}


class RunConfigError(ValueError):
    """A run parameter is wrong; the message names it."""


class RunLockedError(RunConfigError):
    """Another process is running this run id (the message names it: pid, host, start)."""


class WarehouseFullError(RunConfigError):
    """The warehouse's disk is full: every further episode would fail too, so the run stops."""


def _no_space(exc: BaseException | None) -> bool:
    """True when `exc` (or what caused it) is ENOSPC / EDQUOT (chaos: warehouse disk full)."""
    import errno

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@contextlib.contextmanager
def hold_run(wh: Any, run_id: str, wait: bool | float = False) -> Iterator[None]:
    """The run's lock (Warehouse.hold_run, warehouse/runlock.py) for the block;
    RunLockedError (one sentence naming the holder) if another process holds it."""
    from warehouse import RunLocked

    try:
        with wh.hold_run(run_id, wait=wait):
            yield
    except RunLocked as exc:
        raise RunLockedError(str(exc)) from None


def new_run_id(name: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:40].strip("-.") or "run"
    return f"{safe}-{stamp}-{secrets.token_hex(2)}"


def plan(tasks: list[Any], run_id: str, mode: str, samples: int) -> list[EpisodeSpec]:
    if mode not in MODES:
        raise RunConfigError(f"--mode {mode!r}: use one of sandbox, llm, both")
    if samples < 1:
        raise RunConfigError(f"--samples {samples}: must be at least 1")
    return [
        EpisodeSpec(run_id=run_id, task=t, mode=m, sample_index=s)
        for t in tasks
        for m in MODES[mode]
        for s in range(samples)
    ]


def prefect_overhead(outcomes: list[dict[str, Any]]) -> dict[str, float | None]:
    """Prefect's own cost per episode, measured from the task bodies' clocks.

    All tasks are submitted at once, so a worker thread is never idle while work is
    queued: the gap between one task body's end and the next body's start on the same
    thread is what the engine spent finishing one task run and starting the next
    (state changes, events, API calls). Its mean over the episode body's mean is the
    overhead fraction.
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
    import logging

    from warehouse import Warehouse

    t0 = time.perf_counter()
    try:
        res = Warehouse(root).compact(run_id, settle_s=2.0)
    except Exception as exc:
        logging.getLogger(__name__).warning("compaction of run %s failed: %s", run_id, exc)
        return {"seconds": time.perf_counter() - t0, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "seconds": time.perf_counter() - t0,
        "files_before": res.files_before,
        "rows_after": res.rows_after,
        "skipped_bad": [str(b) for b in res.skipped_bad],
        # > 0: merged files kept (hidden) for an open reader; `sandflow warehouse compact` removes them
        "pending_deletes": res.pending_deletes,
    }


def _check_image(backend: str, image: str | None) -> str | None:
    """Fail before fanning out when the engine or the sandbox image is missing (one sentence)."""
    if backend != "docker":
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
    if backend != "docker" or not tag:
        return None
    try:
        from sandbox.engine import docker_client

        return str(docker_client().images.get(tag).id)
    except Exception:  # lineage is informative: never fail a run for it
        return None


def _preflight_model(cfg: Any, model_given: bool) -> Any:
    """tasks.model.preflight, its errors as RunConfigError (one sentence, no traceback)."""
    from tasks.model import ModelError, preflight

    try:
        return preflight(cfg, model_given=model_given)
    except ModelError as exc:
        raise RunConfigError(str(exc)) from None


def _in_process_runner() -> bool:
    """Do this flow's tasks run in this process (the thread task runner)?"""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and isinstance(ctx.task_runner, ThreadPoolTaskRunner)


def _quote_for_runner() -> Any:
    """prefect's quote() with the thread runner, else the identity.

    Why: for every task run Prefect walks each parameter field by field looking for
    upstream futures (an episode has none): ~2/3 of its engine CPU per episode, measured.
    quote() skips that walk. Not with Dask: its runner hands a quoted parameter to the
    worker as a bare tuple.
    """
    if not _in_process_runner():
        return lambda value: value
    from prefect.utilities.annotations import quote

    return quote


def _prewarm_sandboxes(spec: RunSpec, pending: list[EpisodeSpec]) -> None:
    """Start the warm pool's first sandboxes (one per concurrent sandbox episode) now.

    Why: they start while the run still checks its endpoint and writes its run record,
    and all together (the pool paces bigger bursts), instead of one by one as the first
    episodes ask. Only when episodes run in this process (the thread task runner): a
    Dask worker keeps its own pool.
    """
    n = sum(1 for s in pending if s.mode == "sandbox")
    if not n or spec.sandbox_reuse != "pool" or not _in_process_runner():
        return
    from sandbox import prewarm

    prewarm(spec.to_sandbox_config(spec.run_id), min(n, spec.max_sandboxes or spec.concurrency))


def execute_run(spec: RunSpec) -> dict[str, Any]:
    """The body of the run flow (must run inside a Prefect flow: it submits tasks).

    Raises RunLockedError when another process runs this run id (`spec.wait_for_lock`:
    True waits for it, a number waits that many seconds).
    """
    from datasets_prep.prepare import load_taskset
    from flows.episode import reset_cancel
    from warehouse import Warehouse

    t_start = time.perf_counter()
    reset_cancel()
    if spec.concurrency < 1:
        raise RunConfigError(f"--concurrency {spec.concurrency}: must be at least 1")
    if spec.warehouse is None:
        raise RunConfigError("a run needs a warehouse to record its episodes in (--warehouse)")
    root = str(Path(spec.warehouse).expanduser())
    if not spec.base_url and spec.max_model_calls is None:
        # The embedded llama.cpp server answers one request at a time: queueing requests
        # in its socket only makes them time out; queue them here instead.
        spec = spec.model_copy(update={"max_model_calls": 1})
    ts = load_taskset(spec.task_set)
    rid = spec.run_id or new_run_id(ts.name)
    specs = plan(list(ts.tasks), rid, spec.mode, spec.samples)
    wh = Warehouse(root)
    # One run id, one writer (warehouse.runlock): a second process on this run id is
    # refused (or waits), and a kill -9'd holder releases the lock with its death.
    with hold_run(wh, rid, wait=spec.wait_for_lock):
        # Half-written temporary files a killed writer of this run left (invisible, on disk).
        wh.remove_dead_temps(rid)
        # The run keeps the exact tasks it ran (warehouse.tasksets): a resumed run goes on
        # with those, even if its source gives other tasks today.
        ran = wh.run_tasks(rid)
        if ran is None:
            wh.keep_tasks(rid, ts.tasks, name=ts.name)
        elif ran.content_hash != ts.content_hash:
            ts = ran.model_copy(update={"name": ts.name})
            specs = plan(list(ts.tasks), rid, spec.mode, spec.samples)
        return _execute_locked(spec, ts, rid, specs, wh, root, t_start)


def _execute_locked(
    spec: RunSpec, ts: Any, rid: str, specs: list[EpisodeSpec], wh: Any, root: str, t_start: float
) -> dict[str, Any]:
    """execute_run's work once the run's lock is held."""
    from prefect.exceptions import TerminationSignal
    from prefect.futures import as_completed

    from flows import progress
    from flows.episode import make_episode_task, request_cancel
    from tasks.local_model import endpoint

    done = wh.done_keys(rid)
    pending = [s for s in specs if (s.task.id, s.mode, s.sample_index) not in done]
    progress.planned(total=len(pending), skipped=len(specs) - len(pending), run_id=rid)

    image = spec.image
    if "sandbox" in MODES[spec.mode] and pending:
        image = _check_image(spec.backend, spec.image)
    spec = spec.model_copy(update={"run_id": rid, "warehouse": root, "image": image})
    _prewarm_sandboxes(spec, pending)
    previous = wh.run_info(rid)
    outcomes: list[dict[str, Any]] = []
    failures: list[str] = []
    status = "interrupted"
    with endpoint(spec.to_model_config()) as live_cfg:
        if pending:
            live_cfg = _preflight_model(live_cfg, model_given=bool(spec.model) or not spec.base_url)
        # What every episode gets: the resolved spec (the embedded model's address, the model
        # name the server serves), without a key (each process looks its own up).
        spec = spec.model_copy(update={"base_url": live_cfg.base_url, "model": live_cfg.model})
        wh.write_run(
            rid,
            model=live_cfg.model,
            image=image,
            dataset=ts.name,
            dataset_hash=ts.content_hash,
            config={
                "mode": spec.mode,
                "samples": spec.samples,
                "concurrency": spec.concurrency,
                "max_sandboxes": spec.max_sandboxes,
                "max_model_calls": spec.max_model_calls,
                "limits": spec.to_limits().model_dump(),
                "model": live_cfg.public_dict(),
                "backend": spec.backend,
                "network": spec.network,
                "sandbox_reuse": spec.sandbox_reuse,
                "durability": spec.durability,
                "task_set": spec.task_set,
            },
            started_at=(previous or {}).get("started_at"),
            status="running",
            series=spec.series or (previous or {}).get("series"),
            image_id=(_image_id(spec.backend, image) if "sandbox" in MODES[spec.mode] else None)
            or (previous or {}).get("image_id"),
        )
        episode_task = make_episode_task(retries=spec.retries)
        futures: dict[Any, EpisodeSpec] = {}
        try:
            wrap = _quote_for_runner()
            futures = {episode_task.submit(wrap(ep), wrap(spec)): ep for ep in pending}
            for fut in as_completed(list(futures)):
                ep = futures[fut]
                try:
                    out = fut.result()
                except Exception as exc:  # retries exhausted (infra) or a bug: the run goes on
                    if _no_space(exc):  # stop: queued episodes are cancelled, resume finishes them
                        raise WarehouseFullError(
                            f"the warehouse {root} is out of space ({exc}); {len(outcomes)} episode(s) "
                            f"were recorded before it. Free space there, then resume with --run-id {rid}"
                        ) from None
                    failures.append(f"{ep.task.id}/{ep.mode}/{ep.sample_index}: {exc}")
                    progress.finished(ep.key, ok=False, termination="failed")
                    continue
                outcomes.append(out)
                progress.finished(ep.key, ok=True, termination=out.get("termination"))
            status = "finished" if not failures else "failed"
        except (KeyboardInterrupt, TerminationSignal):  # Ctrl+C; SIGTERM (Prefect's bridge)
            # Stop in-flight episodes at their next turn (recorded as interrupted, sandbox
            # closed), let queued ones return at once, and only then stop the model server.
            request_cancel()
            for fut in futures:
                with contextlib.suppress(BaseException):
                    fut.wait(timeout=spec.wall_clock_s)
            raise
        finally:
            try:
                wh.finish_run(rid, status=status, notes=f"{len(failures)} episodes failed" if failures else None)
            except OSError as exc:  # a full disk must not hide the error above; resume rewrites it
                if not _no_space(exc):
                    raise
    compaction = compact_after_run(root, rid) if spec.compact and Path(root).is_dir() else None
    elapsed = time.perf_counter() - t_start  # compaction included: the flow's own end
    overhead = prefect_overhead(outcomes)
    return {
        "run_id": rid,
        "task_set": ts.name,
        "task_set_hash": ts.content_hash,
        "model": live_cfg.model,
        "warehouse": root,
        "planned": len(specs),
        "skipped": len(specs) - len(pending),
        "ran": len(pending),
        "succeeded": len(outcomes),
        "failed": len(failures),
        "failures": failures[:20],
        "terminations": dict(Counter(str(o.get("termination")) for o in outcomes)),
        "elapsed_s": elapsed,
        "episodes_per_s": (len(outcomes) / elapsed) if elapsed > 0 else None,
        "prefect": overhead,
        "compaction": compaction,
        "pid": os.getpid(),
        "worker_pids": sorted({int(o["pid"]) for o in outcomes}),
    }


def make_task_runner(kind: str = "thread", concurrency: int = 4, dask_address: str | None = None) -> Any:
    """ThreadPoolTaskRunner(max_workers=concurrency), or a DaskTaskRunner on a cluster."""
    if kind == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

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

    At the end the run's files are
    compacted (one file per table; `spec.compact=False` skips it); the summary's
    `compaction` says how long that took (inside `elapsed_s`).

    The task runner is the caller's choice: `run_flow.with_options(task_runner=
    make_task_runner(...))(spec)`; the default is a thread pool of 4.
    """
    return execute_run(spec)
