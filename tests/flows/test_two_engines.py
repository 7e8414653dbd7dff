"""Beyond one machine (issue #26): two Docker engines, Dask workers bound each to one, one
warehouse, and the faults of a cluster, each with nothing lost, nothing duplicated and no
sandbox left on either engine.

The second engine is a real dockerd beside the machine's (scripts/engine2.sh, started
once per session by the `second_engine` fixture); the scheduler and the workers are real
processes (tests/two_engines.py), each worker with DOCKER_HOST naming its engine; the run
is `run_flow` with the Dask task runner on that cluster, under the session's Prefect API.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import query, slow_solver
from tests.flows.conftest import new_run_id, run_kwargs, tiny_tasks, write_tasks
from tests.scripted_model import ScriptedModel
from tests.two_engines import (
    FIRST_ENGINE,
    DaskCluster,
    EngineWatch,
    containers_on,
    dask_cluster,
    engine2,
    gc_run,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]

EPISODES = 12


@pytest.fixture
def cluster(tmp_path: Path, second_engine: str) -> Iterator[DaskCluster]:
    with dask_cluster(tmp_path / "dask", {"w1": FIRST_ENGINE, "w2": second_engine}) as c:
        yield c


@pytest.fixture
def model() -> Iterator[ScriptedModel]:
    """Solves every task in 4 turns, 0.3 s per reply: an episode lasts ~2 s."""
    with ScriptedModel(default=slow_solver(0.3), models=("scripted",)) as server:
        yield server


def run_in_background(cluster: DaskCluster, model: ScriptedModel, wh: Path, ts: Path, rid: str) -> Callable[[], dict[str, Any]]:
    """Start the run flow on the cluster in a thread; returns a join() giving its summary."""
    from flows.run import make_task_runner, run_flow

    out: dict[str, Any] = {}

    def body() -> None:
        try:
            runner = make_task_runner("dask", dask_address=cluster.address)
            out["summary"] = run_flow.with_options(task_runner=runner)(
                **run_kwargs(ts, model, wh, run_id=rid, mode="sandbox", concurrency=4, retries=3)
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def join() -> dict[str, Any]:
        t.join(timeout=600)
        assert not t.is_alive(), "the run did not end within 10 minutes"
        if "error" in out:
            raise out["error"]
        return out["summary"]

    return join


def assert_exactly_once(wh: Path, rid: str, n: int) -> None:
    """Every planned episode recorded once, each a model result (no infra failure left)."""
    rows = query(wh, f"SELECT episode_id, count(*), any_value(termination) FROM episodes WHERE run_id = '{rid}' GROUP BY 1")
    assert len(rows) == n, f"{len(rows)} episodes recorded, {n} planned"
    assert all(c == 1 for _, c, _ in rows), [r for r in rows if r[1] != 1]
    assert {t for _, _, t in rows} == {"submitted"}, rows
    # the turns of each episode: its latest attempt's only (4 turns, indexes 0..3 once each)
    turns = query(wh, f"SELECT episode_id, count(*), count(DISTINCT turn_index) FROM turns WHERE run_id = '{rid}' GROUP BY 1")
    assert len(turns) == n and all(c == d == 4 for _, c, d in turns), turns


def assert_no_sandbox_left(rid: str, engines: list[str]) -> None:
    for host in engines:
        gc_run(host, rid)  # what died with a stopped engine comes back as `exited` records
        assert containers_on(host, rid) == [], (host, containers_on(host, rid))


def test_one_run_on_two_engines_survives_a_killed_worker_that_comes_back(
    tmp_path: Path, cluster: DaskCluster, model: ScriptedModel, second_engine: str
) -> None:
    """Episodes land on both engines; worker 2 (engine 2) is killed -9 with its nanny
    mid-run, its episodes finish on worker 1; it is started again, rejoins and takes work."""
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(EPISODES))
    wh, rid = tmp_path / "wh", new_run_id("two-engines")
    engines = {"first": FIRST_ENGINE, "second": second_engine}
    with EngineWatch(engines, rid) as watch:
        join = run_in_background(cluster, model, wh, ts, rid)
        wait_until(lambda: watch.live_on("second") > 0, 120, "a sandbox on the second engine")
        cluster.kill_worker("w2")
        killed_with = set(watch.episodes["second"])
        cluster.start_worker("w2", second_engine)  # the host is back: it rejoins
        summary = join()
    assert summary["failed"] == 0 and summary["succeeded"] == EPISODES, summary
    assert_exactly_once(wh, rid, EPISODES)
    # both engines ran episodes, and the restarted worker took work after it rejoined
    assert watch.episodes["first"] and watch.episodes["second"], watch.episodes
    assert watch.episodes["second"] - killed_with, "the restarted worker took no episode"
    # each episode names the engine its latest attempt's sandbox ran on, as the engines' events tell
    ran_on = dict(query(wh, f"SELECT episode_id, sandbox_engine FROM episodes WHERE run_id = '{rid}'"))
    names = {f"docker {addr}": name for name, addr in engines.items()}
    assert {ep: names.get(e, e) for ep, e in ran_on.items()} == watch.last_engine
    assert {h for (h,) in query(wh, f"SELECT DISTINCT worker_host FROM episodes WHERE run_id = '{rid}'")} == {socket.gethostname()}
    assert_no_sandbox_left(rid, list(engines.values()))


def test_second_engine_stopped_mid_run(
    tmp_path: Path, cluster: DaskCluster, model: ScriptedModel, second_engine: str
) -> None:
    """The second engine's dockerd is killed -9 (a crash: its sandboxes' connections break
    at once) and stays down: its worker closes itself (flows/dask_worker.py) and its
    episodes, the running ones too, finish on the first engine; none is recorded as failed,
    none twice. (A graceful stop, `engine2.sh halt`, lets running sandboxes finish within
    its shutdown timeout, so whether one is cut off is a matter of timing.)"""
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(EPISODES))
    wh, rid = tmp_path / "wh", new_run_id("engine-down")
    engines = {"first": FIRST_ENGINE, "second": second_engine}
    with EngineWatch(engines, rid) as watch:
        join = run_in_background(cluster, model, wh, ts, rid)
        wait_until(lambda: watch.live_on("second") > 0, 120, "a sandbox on the second engine")
        engine2("crash")  # the fixture put this engine's settings in os.environ
        try:
            summary = join()
            wait_until(lambda: cluster.workers["w2"].proc.poll() is not None, 30, "worker w2 to close itself")
        finally:
            engine2("start")
    assert summary["failed"] == 0 and summary["succeeded"] == EPISODES, summary
    assert_exactly_once(wh, rid, EPISODES)
    # the episodes cut off on the second engine ran again on the first
    assert watch.episodes["second"] & watch.episodes["first"], watch.episodes
    assert "its Docker engine is gone" in cluster.workers["w2"].log.read_text()
    assert_no_sandbox_left(rid, list(engines.values()))


def test_scheduler_restarted_mid_run(
    tmp_path: Path, cluster: DaskCluster, model: ScriptedModel, second_engine: str
) -> None:
    """kill -9 of the scheduler and a new one on its address, with episodes running on both
    engines: every future is gone with it; the run resubmits the episodes it had not got
    back (flows/executor.py), the workers (which exit with their scheduler) are started
    again by their supervisor and join the new one, and the run ends with every episode
    recorded once."""
    ts = write_tasks(tmp_path / "t.parquet", tiny_tasks(EPISODES))
    wh, rid = tmp_path / "wh", new_run_id("scheduler")
    engines = {"first": FIRST_ENGINE, "second": second_engine}
    with EngineWatch(engines, rid) as watch:
        join = run_in_background(cluster, model, wh, ts, rid)
        wait_until(lambda: watch.live_on("second") > 0 and watch.live_on("first") > 0, 120, "sandboxes on both engines")
        cluster.restart_scheduler()
        cluster.restart_exited_workers()
        summary = join()
    assert summary["failed"] == 0, summary["failures"][:3]
    assert summary["failed"] == 0 and summary["succeeded"] == EPISODES, summary
    assert_exactly_once(wh, rid, EPISODES)
    assert cluster.live_workers() == {"w1", "w2"}  # both rejoined the new scheduler
    assert watch.episodes["first"] and watch.episodes["second"], watch.episodes
    assert_no_sandbox_left(rid, list(engines.values()))
