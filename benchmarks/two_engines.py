"""Benchmark: one run on two Docker engines, with one Dask worker killed in the middle.

A second dockerd is started beside this machine's engine (scripts/engine2.sh, unless one
answers already), a Dask scheduler and two workers run as processes (tests/two_engines.py):
w1 on the first engine, w2 on the second, 2 threads each (so at most 2 live sandboxes
per engine, 4 in all). N sandbox-mode episodes (default 64) of a scripted model that
solves each task in 4 turns (0.2 s per reply) run through `run_flow` with the Dask task
runner, under a temporary Prefect server. When half of the episodes have opened their
sandbox, w2 is killed -9 with its nanny (the host is gone) and started again at once
(its supervisor): its running episodes go to w1, and it rejoins and takes work.

Counted from the warehouse (DuckDB) and both engines' container events:
  episodes_lost        planned episodes with no `submitted` record
  episodes_duplicated  episode ids recorded more than once (the view must show one each)
  max_live_over_limit  the most live sandboxes of the run on one engine above its worker's
                       thread count, summed over engines, and over all engines together
                       above the total (0: the bounds held, kill and restart included)
  leaked               containers of the run on either engine after the run and a gc
  share_second_engine  episodes whose latest attempt opened its sandbox on the second engine
                       / episodes (goal >= 0.3)

    .venv/bin/python benchmarks/two_engines.py [--episodes 64] [--keep-engine]

Needs root, dockerd and the sandbox image. Ends with ONE JSON line (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="sandflow-bench-prefect-"))
from flows import prefect_env  # noqa: E402

prefect_env.apply()  # Prefect settings before prefect is imported (as the CLI does)

from tests.chaos.conftest import slow_solver  # noqa: E402
from tests.flows.conftest import tiny_tasks, write_tasks  # noqa: E402
from tests.scripted_model import ScriptedModel  # noqa: E402
from tests.two_engines import (  # noqa: E402
    FIRST_ENGINE,
    EngineWatch,
    containers_on,
    dask_cluster,
    engine2,
    gc_run,
    wait_until,
)

THREADS = 2  # per worker: the bound on live sandboxes per engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--keep-engine", action="store_true", help="leave the second engine running at the end")
    args = ap.parse_args()
    if args.episodes < 4:
        print("two_engines.py: --episodes must be at least 4", file=sys.stderr)
        sys.exit(2)

    from flows.prefect_server import pointed_at, temporary_server
    from flows.run import make_task_runner, run_flow
    from tasks.spec import build_run_spec
    from warehouse.query import connect

    t0 = time.monotonic()
    try:
        second = engine2("status")
        started = False
    except RuntimeError:
        second = engine2("start")
        started = True
    print(f"second engine: {second} ({'started' if started else 'already running'}, {time.monotonic() - t0:.0f} s)")
    tmp = Path(tempfile.mkdtemp(prefix="sandflow-bench-two-engines-"))
    ts = write_tasks(tmp / "tasks.parquet", tiny_tasks(args.episodes))
    wh, rid = tmp / "wh", f"bench-two-engines-{os.getpid()}"
    engines = {"first": FIRST_ENGINE, "second": second}
    killed_at: list[int] = []
    try:
        with (
            temporary_server() as api,
            pointed_at(api),
            ScriptedModel(default=slow_solver(0.2), models=("scripted",)) as model,
            dask_cluster(tmp / "dask", {"w1": FIRST_ENGINE, "w2": second}, nthreads=THREADS) as cluster,
            EngineWatch(engines, rid) as watch,
        ):
            out: dict[str, object] = {}

            def run() -> None:
                spec = build_run_spec(task_set=str(ts), model="scripted", base_url=model.url, mode="sandbox",
                                      concurrency=2 * THREADS, max_steps=6, warehouse=str(wh), wall_clock_s=300.0,
                                      run_id=rid, retries=3)  # fmt: skip
                out["summary"] = run_flow.with_options(task_runner=make_task_runner("dask", dask_address=cluster.address))(spec)

            t_run = time.monotonic()
            th = threading.Thread(target=run, daemon=True)
            th.start()
            half = args.episodes // 2
            wait_until(lambda: len(watch.last_engine) >= half and watch.live_on("second") > 0, 600,
                       "half of the episodes to start, one on the second engine")  # fmt: skip
            killed_at.append(len(watch.last_engine))
            cluster.kill_worker("w2")
            print(f"killed w2 (-9, with its nanny) after {killed_at[0]} episodes had started; starting it again")
            cluster.start_worker("w2", second, THREADS)
            th.join(timeout=1800)
            elapsed = time.monotonic() - t_run
            summary: dict[str, Any] = out.get("summary") or {}  # type: ignore[assignment]
        with connect(wh) as q:
            rows = q.rows(f"SELECT episode_id, count(*), sum((termination = 'submitted')::int) FROM episodes WHERE run_id = '{rid}' GROUP BY 1")
        submitted = sum(1 for _, _, s in rows if s)
        lost = args.episodes - submitted
        duplicated = sum(1 for _, c, _ in rows if c > 1)
        over = sum(max(0, watch.max_live[e] - THREADS) for e in engines)
        over += max(0, watch.max_live_total - THREADS * len(engines))
        for host in engines.values():
            gc_run(host, rid)
        leaked = sum(len(containers_on(host, rid)) for host in engines.values())
        last = list(watch.last_engine.values())
        share = last.count("second") / args.episodes
    finally:
        if started and not args.keep_engine:
            engine2("stop")
    print(f"{args.episodes} episodes in {elapsed:.1f} s; {submitted} submitted, failed {summary.get('failed')}; "
          f"per engine (latest attempt): first {last.count('first')}, second {last.count('second')}; "
          f"max live: first {watch.max_live['first']}, second {watch.max_live['second']}, "
          f"both {watch.max_live_total} (limit {THREADS} per engine)")  # fmt: skip
    print(json.dumps({
        "benchmark": "two_engines",
        "episodes": args.episodes,
        "episodes_lost": lost,
        "episodes_duplicated": duplicated,
        "max_live_over_limit": over,
        "leaked": leaked,
        "share_second_engine": round(share, 3),
        "killed_after_started": killed_at[0] if killed_at else None,
        "episodes_run_on_both_engines": len(watch.episodes["first"] & watch.episodes["second"]),
        "max_live_first": watch.max_live["first"],
        "max_live_second": watch.max_live["second"],
        "max_live_total": watch.max_live_total,
        "failed": summary.get("failed"),
        "elapsed_s": round(elapsed, 1),
        "episodes_per_s": round(args.episodes / elapsed, 2) if elapsed else None,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
