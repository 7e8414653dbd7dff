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

from flows.episode import EpisodeSettings, EpisodeSpec

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
def hold_run(layout: Any, run_id: str, wait: bool | float = False) -> Iterator[None]:
    """The run's lock (warehouse.runlock) for the block; RunLockedError if it is taken."""
    from warehouse.runlock import RunLock, RunLocked

    lock = RunLock(layout, run_id)
    try:
        lock.acquire(wait=wait)
    except RunLocked as exc:
        raise RunLockedError(str(exc)) from None
    try:
        yield
    finally:
        lock.release()


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
    snapshot; the merged inputs are deleted once no session is open). A failure here never
    fails the run: its episodes are recorded either way, and the error is reported.
    """
    import logging

    from warehouse.store import Warehouse

    t0 = time.perf_counter()
    wh = Warehouse(root)
    try:
        res = wh.compact(run_id)
        # A query session open right now (`sandflow sql`, another flow) keeps the merged
        # files on disk, hidden; give it a moment to close, then delete them, so a finished
        # run does not keep two copies of its data until someone compacts it again.
        deadline = time.monotonic() + 2.0
        while res.pending_deletes and time.monotonic() < deadline:
            time.sleep(0.2)
            if wh.layout.readers_idle():
                res.pending_deletes = wh.compact(run_id).pending_deletes
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
    """Fail before fanning out when the sandbox image is missing (one clear sentence)."""
    if backend != "docker":
        return image
    from sandbox.image import DEFAULT_SPEC

    tag = image or DEFAULT_SPEC.tag
    try:
        import docker

        client = docker.from_env(timeout=20)
        client.images.get(tag)
    except Exception as exc:
        name = type(exc).__name__
        if name == "ImageNotFound":
            raise RunConfigError(
                f"sandbox image {tag} is not built on this Docker engine: run `sandflow image build`"
            ) from None
        raise RunConfigError(
            f"no Docker engine answers ({name}: {str(exc)[:160]}); start dockerd or set DOCKER_HOST "
            "(or use --mode llm, which needs no sandbox)"
        ) from None
    return tag


def _image_id(backend: str, tag: str | None) -> str | None:
    """The engine's id of the sandbox image (lineage: a rebuilt image under one tag)."""
    if backend != "docker" or not tag:
        return None
    try:
        import docker

        return str(docker.from_env(timeout=20).images.get(tag).id)
    except Exception:  # lineage is informative: never fail a run for it
        return None


def _preflight_model(cfg: Any) -> None:
    from tasks.model import ModelClient

    client = ModelClient(cfg)
    try:
        served = client.served_models(timeout_s=15)
    except Exception as exc:
        raise RunConfigError(f"the model endpoint {cfg.base_url} does not answer: {exc}") from None
    finally:
        client.close()
    if served and cfg.model not in served:
        raise RunConfigError(
            f"the endpoint {cfg.base_url} does not serve model {cfg.model!r}; it serves: {', '.join(served[:10])}"
        )


def execute_run(
    *,
    task_set: str,
    model: str | None,
    base_url: str | None,
    mode: str,
    samples: int,
    concurrency: int,
    max_sandboxes: int | None,
    max_model_calls: int | None,
    max_steps: int,
    temperature: float,
    max_tokens: int,
    wall_clock_s: float,
    exec_timeout_s: float | None,
    warehouse: str,
    run_id: str | None,
    network: str,
    backend: str,
    image: str | None,
    retries: int,
    durability: str,
    extra_body: dict[str, Any] | None,
    logprobs: bool,
    return_token_ids: bool,
    request_timeout_s: float | None = None,
    compact: bool = True,
    series: str | None = None,
    wait_for_lock: bool | float = False,
    sandbox_reuse: str = "fresh",
) -> dict[str, Any]:
    """The body of the run flow (must run inside a Prefect flow: it submits tasks).

    Raises RunLockedError when another process runs this run id (`wait_for_lock`: True
    waits for it, a number waits that many seconds).
    """
    from prefect.exceptions import TerminationSignal
    from prefect.futures import as_completed

    from flows import progress
    from flows.episode import make_episode_task, request_cancel, reset_cancel
    from flows.store import done_keys
    from flows.tasksets import resolve_taskset
    from sandbox.base import SandboxConfig, SandboxLimits
    from tasks.local_model import endpoint
    from tasks.loop import Limits
    from tasks.model import ModelConfig
    from warehouse.compact import remove_dead_temps
    from warehouse.layout import Layout
    from warehouse.runs import finish_run, read_run, write_run

    t_start = time.perf_counter()
    reset_cancel()
    if concurrency < 1:
        raise RunConfigError(f"--concurrency {concurrency}: must be at least 1")
    if not base_url and max_model_calls is None:
        # The embedded llama.cpp server answers one request at a time: queueing requests
        # in its socket only makes them time out; queue them here instead.
        max_model_calls = 1
    if request_timeout_s is None:
        # The embedded server stops a generation when its client leaves and bounds each
        # call's tokens (tasks/local_model_app.py): a timed-out call frees it at once, so
        # its retry no longer queues behind abandoned work and needs no longer wait.
        request_timeout_s = 120.0
    ts = resolve_taskset(task_set)
    rid = run_id or new_run_id(ts.name)
    specs = plan(list(ts.tasks), rid, mode, samples)
    root = str(Path(warehouse).expanduser())
    layout = Layout(root)
    # One run id, one writer (warehouse.runlock): a second process on this run id is
    # refused (or waits), and a kill -9'd holder releases the lock with its death.
    with hold_run(layout, rid, wait=wait_for_lock):
        # Half-written temporary files a killed writer of this run left (invisible, on disk).
        remove_dead_temps(layout, rid)
        done = done_keys(root, rid) if Path(root).exists() else set()
        pending = [s for s in specs if s.key not in done]
        progress.planned(total=len(pending), skipped=len(specs) - len(pending), run_id=rid)

        sandbox_image = _check_image(backend, image) if "sandbox" in MODES[mode] and pending else image
        model_cfg = ModelConfig(
            model=model or "default",
            base_url=base_url,
            temperature=temperature,
            max_tokens=max_tokens,
            extra_body=extra_body or {},
            logprobs=logprobs,
            return_token_ids=return_token_ids,
            request_timeout_s=request_timeout_s,
        )
        limits = Limits(max_steps=max_steps, wall_clock_s=wall_clock_s, exec_timeout_s=exec_timeout_s)
        sandbox_cfg = SandboxConfig(
            backend=backend,
            image=sandbox_image,
            run_id=rid,
            limits=SandboxLimits(network=network),
            reuse=sandbox_reuse,  # pydantic checks "pool" / "fresh"
        )
        previous = read_run(layout, rid) if Path(root).exists() else None
        outcomes: list[dict[str, Any]] = []
        failures: list[str] = []
        status = "interrupted"
        with endpoint(model_cfg) as live_cfg:
            if pending:
                _preflight_model(live_cfg)
            write_run(
                layout,
                rid,
                model=live_cfg.model,
                image=sandbox_image,
                dataset=ts.name,
                dataset_hash=ts.content_hash,
                config={
                    "mode": mode,
                    "samples": samples,
                    "concurrency": concurrency,
                    "max_sandboxes": max_sandboxes,
                    "max_model_calls": max_model_calls,
                    "limits": limits.model_dump(),
                    "model": live_cfg.public_dict(),
                    "backend": backend,
                    "network": network,
                    "task_set": task_set,
                },
                started_at=(previous or {}).get("started_at"),
                status="running",
                series=series or (previous or {}).get("series"),
                image_id=(_image_id(backend, sandbox_image) if "sandbox" in MODES[mode] else None)
                or (previous or {}).get("image_id"),
            )
            settings = EpisodeSettings(
                model=live_cfg.model_copy(update={"api_key": None}),
                sandbox=sandbox_cfg,
                limits=limits,
                warehouse=root,
                max_sandboxes=max_sandboxes or concurrency,
                max_model_calls=max_model_calls,
                durability=durability,
            )
            episode_task = make_episode_task(retries=retries)
            futures: dict[Any, EpisodeSpec] = {}
            try:
                futures = {episode_task.submit(spec, settings): spec for spec in pending}
                for fut in as_completed(list(futures)):
                    spec = futures[fut]
                    try:
                        out = fut.result()
                    except Exception as exc:  # retries exhausted (infra) or a bug: the run goes on
                        if _no_space(exc):  # stop: queued episodes are cancelled, resume finishes them
                            raise WarehouseFullError(
                                f"the warehouse {root} is out of space ({exc}); {len(outcomes)} episode(s) "
                                f"were recorded before it. Free space there, then resume with --run-id {rid}"
                            ) from None
                        failures.append(f"{spec.task.id}/{spec.mode}/{spec.sample_index}: {exc}")
                        progress.finished(spec.key, ok=False, termination="failed")
                        continue
                    outcomes.append(out)
                    progress.finished(spec.key, ok=True, termination=out.get("termination"))
                status = "finished" if not failures else "failed"
            except (KeyboardInterrupt, TerminationSignal):  # Ctrl+C; SIGTERM (Prefect's bridge)
                # Stop in-flight episodes at their next turn (recorded as interrupted, sandbox
                # closed), let queued ones return at once, and only then stop the model server.
                request_cancel()
                for fut in futures:
                    with contextlib.suppress(BaseException):
                        fut.wait(timeout=wall_clock_s)
                raise
            finally:
                try:
                    finish_run(layout, rid, status=status, notes=f"{len(failures)} episodes failed" if failures else None)
                except OSError as exc:  # a full disk must not hide the error above; resume rewrites it
                    if not _no_space(exc):
                        raise
        compaction = compact_after_run(root, rid) if compact and Path(root).is_dir() else None
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
def run_flow(
    task_set: str = "smoke",
    model: str | None = None,
    base_url: str | None = None,
    mode: str = "both",
    samples: int = 1,
    concurrency: int = 4,
    max_sandboxes: int | None = None,
    max_model_calls: int | None = None,
    max_steps: int = 30,
    temperature: float = 0.7,
    max_tokens: int = 2048,
    wall_clock_s: float = 900.0,
    exec_timeout_s: float | None = None,
    warehouse: str = "warehouse_data",
    run_id: str | None = None,
    network: str = "none",
    backend: str = "docker",
    image: str | None = None,
    retries: int = 2,
    durability: str = "turn",
    extra_body: dict[str, Any] | None = None,
    logprobs: bool = False,
    return_token_ids: bool = False,
    request_timeout_s: float | None = None,
    compact: bool = True,
    series: str | None = None,
    wait_for_lock: bool | float = False,
    sandbox_reuse: str = "fresh",
) -> dict[str, Any]:
    """Run a task set against a model in sandbox and/or LLM mode; resumable by run id.

    One process per run id: a second one raises RunLockedError naming the holder, or
    with `wait_for_lock` waits for it (True: as long as it takes; seconds: that long).

    At the end the run's files are compacted (one file per table; `compact=False` skips
    it); the summary's `compaction` says how long that took (inside `elapsed_s`).

    The task runner is the caller's choice: `run_flow.with_options(task_runner=
    make_task_runner(...))(...)`; the default is a thread pool of 4.
    """
    return execute_run(**dict(locals()))
