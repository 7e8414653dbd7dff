"""Benchmark: many episodes at high sandbox concurrency, through the real CLI, then through Dask.

N sandbox-mode episodes (default 200) of a scripted model that solves each task in 4
turns and answers instantly, at C concurrent sandboxes (default 16), on this host's
Docker engine. Three passes, the same work each time, each under its own run id:

1. floor: the episode body (`engine.episode.run_one`) in a plain ThreadPoolExecutor of C
   threads in this process: no Prefect, no CLI; what the machine can do at all.
2. flow: `sandflow flows run ... --concurrency C` as a subprocess (Prefect ephemeral
   mode, thread task runner). Its RSS is sampled from /proc every 0.2 s (peak reported).
3. dask: the same command with `--task-runner dask --dask-address` on a LocalCluster of
   2 worker processes (C/2 threads each) on 127.0.0.1.

After each pass the warehouse is read with DuckDB (episodes not 'submitted' count as
failed) and the engine is asked for containers labelled with the run id (leaked).

    .venv/bin/python benchmarks/load.py [--episodes 200] [--concurrency 16] [--no-dask]

Ends with ONE JSON line: episodes, concurrency, failed, leaked, peak_rss_mb,
episodes_per_s, dask_episodes_per_s, floor_episodes_per_s, flow_vs_floor,
dask_vs_floor, dask_failed, dask_leaked (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows import prefect_env  # noqa: E402

prefect_env.apply()  # Prefect settings before prefect is imported (as the CLI does)
from tests.flows.conftest import solver, tiny_tasks, write_tasks  # noqa: E402
from tests.scripted_model import ScriptedModel  # noqa: E402

SANDFLOW = str(Path(sys.executable).parent / "sandflow")


def _rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS = VmHWM) of `pid` in MB; (0, 0) once it is gone."""
    cur = peak = 0.0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return cur, peak


def _outcome(wh: Path, run_id: str, episodes: int) -> tuple[int, int]:
    """(failed, leaked): episodes not recorded as submitted; containers left by label."""
    from sandbox.engine import docker_client
    from warehouse.query import connect

    submitted = 0
    if wh.exists():
        with connect(wh, run_id=run_id) as q:
            submitted = q.rows(
                f"SELECT count(*) FROM episodes WHERE run_id = '{run_id}' AND termination = 'submitted'"
            )[0][0]
    leaked = docker_client().containers.list(ignore_removed=True, all=True, filters={"label": f"sandflow.run_id={run_id}"})
    return episodes - int(submitted), len(leaked)


def floor_pass(ts_tasks: list[Any], model: ScriptedModel, wh: Path, run_id: str, concurrency: int) -> float:
    from engine.episode import run_one
    from engine.plan import plan
    from tasks.spec import build_run_spec

    specs = plan(ts_tasks, run_id, "sandbox", 1)
    settings = build_run_spec(
        model="scripted",
        base_url=model.url,
        network="none",
        max_steps=6,
        wall_clock_s=300,
        warehouse=str(wh),
        max_sandboxes=concurrency,
        durability="turn",
    )
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(lambda s: run_one(s, settings), specs))
    return time.perf_counter() - t0


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[str]:
    """A real `prefect server start` on 127.0.0.1 (free port); yields its API URL.

    The Dask pass needs one: in ephemeral mode each Dask worker process would start its
    own API server and its task runs fail ("Server process did not start", see
    docs/reliability.md), so Dask runs go through a server, as deployments do.
    """
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING")
    for k in ("TASK_RUN_RECORDER_BATCH_SIZE", "TASK_RUN_RECORDER_READ_BATCH_SIZE"):
        env[f"PREFECT_SERVER_SERVICES_{k}"] = "200"
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"prefect server did not start; see {home / 'server.log'}")
            time.sleep(0.5)
        yield api
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@contextlib.contextmanager
def dask_cluster(concurrency: int, api_url: str) -> Iterator[str]:
    """A LocalCluster of 2 worker processes on 127.0.0.1 whose Prefect talks to `api_url`."""
    import logging

    from distributed import LocalCluster

    logging.getLogger("distributed").setLevel(logging.WARNING)
    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api_url  # inherited by the worker processes
    try:
        with LocalCluster(
            n_workers=2, threads_per_worker=max(1, concurrency // 2), processes=True,
            host="127.0.0.1", dashboard_address=None, silence_logs=logging.WARNING,
        ) as cluster:  # fmt: skip
            yield cluster.scheduler_address
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old


def cli_pass(
    ts: Path, model: ScriptedModel, wh: Path, run_id: str, concurrency: int, prefect_home: Path,
    extra: list[str] | None = None, api_url: str | None = None, timeout_s: float = 900,
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(prefect_home), PREFECT_LOGGING_LEVEL="WARNING", COLUMNS="200")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    args = [
        SANDFLOW, "flows", "run", str(ts), "--base-url", model.url, "--model", "scripted",
        "--mode", "sandbox", "--concurrency", str(concurrency), "--max-steps", "6",
        "--wall-clock", "300", "--warehouse", str(wh), "--run-id", run_id, *(extra or []),
    ]  # fmt: skip
    log = prefect_home / f"{run_id}.log"
    peak = 0.0
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        while proc.poll() is None:
            peak = max(peak, _rss_mb(proc.pid)[1])
            if time.perf_counter() - t0 > timeout_s:  # a stalled run must not stall the benchmark
                print(f"{run_id}: no end after {timeout_s:g}s; killed (counted as failed)", file=sys.stderr)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.2)
    elapsed = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    # The CLI prints its own elapsed time for the run itself (Prefect start-up excluded).
    run_s = None
    for line in text.splitlines():
        if f"{run_id}:" in line and " recorded," in line:
            with contextlib.suppress(IndexError, ValueError):
                run_s = float(line.split(";")[1].split("s,")[0].strip())
    return {"rc": proc.returncode, "wall_s": elapsed, "run_s": run_s, "peak_rss_mb": peak, "log": text[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-dask", action="store_true", help="skip the Dask pass")
    ap.add_argument("--no-floor", action="store_true", help="skip the in-process floor pass")
    ap.add_argument("--no-flow", action="store_true", help="skip the thread-runner CLI pass")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, warehouses)")
    ap.add_argument("--pass-timeout", type=float, default=900, help="kill a pass after this many seconds")
    a = ap.parse_args()
    from sandflow.host import apply_host_settings

    apply_host_settings()  # SANDFLOW_* settings, handed to the libraries as the CLI does
    if a.episodes < 1 or a.concurrency < 1:
        ap.error("--episodes and --concurrency must be at least 1")
    stamp = f"{os.getpid()}-{int(time.time())}"
    tmp = Path(tempfile.mkdtemp(prefix="sandflow-load-"))
    tasks = tiny_tasks(a.episodes)
    ts = write_tasks(tmp / "load.parquet", tasks, name="load")
    home = tmp / "prefect-home"
    home.mkdir()
    res: dict[str, Any] = {"episodes": a.episodes, "concurrency": a.concurrency}
    with ScriptedModel(default=solver, models=("scripted",)) as model:
        if not a.no_floor:
            rid = f"load-floor-{stamp}"
            floor_s = floor_pass(tasks, model, tmp / "wh-floor", rid, a.concurrency)
            failed, leaked = _outcome(tmp / "wh-floor", rid, a.episodes)
            res["floor_episodes_per_s"] = round(a.episodes / floor_s, 3)
            print(f"floor: {a.episodes} episodes in {floor_s:.1f}s, {failed} failed, {leaked} leaked", flush=True)

        rid = f"load-flow-{stamp}"
        r: dict[str, Any] = {"rc": 0, "wall_s": 1.0, "run_s": None, "peak_rss_mb": 0.0, "log": ""} if a.no_flow else cli_pass(
            ts, model, tmp / "wh-flow", rid, a.concurrency, home, timeout_s=a.pass_timeout
        )
        failed, leaked = (0, 0) if a.no_flow else _outcome(tmp / "wh-flow", rid, a.episodes)
        run_s = r["run_s"] or r["wall_s"]
        if not a.no_flow:
            res.update(
                failed=failed, leaked=leaked, peak_rss_mb=round(r["peak_rss_mb"], 1),
                episodes_per_s=round(a.episodes / run_s, 3), flow_wall_s=round(r["wall_s"], 1),
            )  # fmt: skip
        print(
            "flow:  skipped" if a.no_flow else f"flow:  {a.episodes} episodes in {run_s:.1f}s (process {r['wall_s']:.1f}s), rc={r['rc']}, "
            f"{failed} failed, {leaked} leaked, peak RSS {r['peak_rss_mb']:.0f} MB",
            flush=True,
        )
        if r["rc"] != 0:
            print(r["log"], file=sys.stderr)

        if not a.no_dask:

            rid = f"load-dask-{stamp}"
            with prefect_server(tmp / "server-home") as api, dask_cluster(a.concurrency, api) as address:
                r = cli_pass(
                    ts, model, tmp / "wh-dask", rid, a.concurrency, home,
                    ["--task-runner", "dask", "--dask-address", address], api_url=api, timeout_s=a.pass_timeout,
                )  # fmt: skip
            failed, leaked = _outcome(tmp / "wh-dask", rid, a.episodes)
            run_s = r["run_s"] or r["wall_s"]
            res.update(dask_failed=failed, dask_leaked=leaked, dask_episodes_per_s=round(a.episodes / run_s, 3))
            print(
                f"dask:  {a.episodes} episodes in {run_s:.1f}s, rc={r['rc']}, {failed} failed, {leaked} leaked",
                flush=True,
            )
            if r["rc"] != 0:
                print(r["log"], file=sys.stderr)
    floor = res.get("floor_episodes_per_s")
    if floor:
        if "episodes_per_s" in res:
            res["flow_vs_floor"] = round(res["episodes_per_s"] / floor, 3)
        if "dask_episodes_per_s" in res:
            res["dask_vs_floor"] = round(res["dask_episodes_per_s"] / floor, 3)
    if a.keep:
        print(f"kept {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
