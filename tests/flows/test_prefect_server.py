"""A real Prefect server on PostgreSQL runs the schedule (issue #26, docs/pipeline.md
"A Prefect server on PostgreSQL"):

- sandflow's own PostgreSQL (scripts/postgres.sh; `scripts/setup.sh --postgres` starts it,
  CI asks for it) holds a fresh database for this module, and `prefect server start --host
  127.0.0.1` uses it through PREFECT_API_DATABASE_CONNECTION_URL (asyncpg);
- prefect.yaml's nightly deployment is created on it, a process worker polls the
  `sandflow-process` pool, and a run of the deployment is triggered (not its cron) on a Dask
  cluster of two worker processes, each opening its sandboxes on its own Docker engine (the
  machine's and a second one: scripts/engine2.sh, tests/two_engines.py);
- the global concurrency limits `sandflow-sandboxes` and `sandflow-model-calls` hold across
  those two workers and engines: live sandboxes on both engines together, the limits' active
  slots and model calls in flight, sampled during the run, reach the limits and never pass
  them, while both workers and both engines held sandboxes;
- the run writes its report, and its Prefect artifacts are read back through the API (and
  found in PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.flows.conftest import solver, tiny_tasks, write_tasks
from tests.flows.prefect_servers import BIN, REPO, api, prefect, prefect_server, stopped_at_exit
from tests.scripted_model import Reply, ScriptedModel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("docker_image")]

SANDBOX_LIMIT, MODEL_LIMIT = 2, 1  # the global limits of the limits test
FIRST_ENGINE = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _postgres_url() -> str:
    """The URL of sandflow's PostgreSQL (scripts/postgres.sh), or the test fails saying how."""
    r = subprocess.run(["bash", str(REPO / "scripts" / "postgres.sh"), "url"], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.startswith("postgresql+asyncpg://"):
        message = f"needs sandflow's PostgreSQL: bash scripts/setup.sh --postgres ({r.stderr.strip()})"
        if os.environ.get("CI") == "true":  # .ci/run asks for it: missing there is a failure
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return r.stdout.strip()


async def _admin(url: str, statement: str) -> None:
    import asyncpg

    base = url.replace("postgresql+asyncpg://", "postgresql://").rsplit("/", 1)[0]
    con = await asyncpg.connect(f"{base}/postgres")
    try:
        await con.execute(statement)
    finally:
        await con.close()


async def _fetch(url: str, query: str) -> list[Any]:
    import asyncpg

    con = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return list(await con.fetch(query))
    finally:
        await con.close()


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh database in sandflow's PostgreSQL for this module, dropped after."""
    url = _postgres_url()
    name = f"sandflow_test_{uuid.uuid4().hex[:10]}"
    asyncio.run(_admin(url, f"CREATE DATABASE {name}"))
    try:
        yield f"{url.rsplit('/', 1)[0]}/{name}"
    finally:
        asyncio.run(_admin(url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture(scope="module")
def server(database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`prefect server start` on 127.0.0.1 with PostgreSQL; prefect.yaml's nightly deployed
    (its cron stays: the runs here are triggered); a process worker on its pool."""
    work = tmp_path_factory.mktemp("prefect-pg")
    with prefect_server(work, PREFECT_API_DATABASE_CONNECTION_URL=database) as env:
        env = dict(env, SANDFLOW_REPO=str(REPO))
        for args in (("work-pool", "create", "sandflow-process", "--type", "process"),
                     ("--no-prompt", "deploy", "--name", "nightly")):  # fmt: skip
            r = prefect(env, *args)
            assert r.returncode == 0, r.stdout + r.stderr
        for name, limit in (("sandflow-sandboxes", SANDBOX_LIMIT), ("sandflow-model-calls", MODEL_LIMIT)):
            r = prefect(env, "global-concurrency-limit", "create", name, "--limit", str(limit))
            assert r.returncode == 0, r.stdout + r.stderr
        # the worker runs flows from this checkout (PYTHONPATH: the code under test)
        worker_env = dict(env, PYTHONPATH=str(REPO), PREFECT_WORKER_QUERY_SECONDS="2")
        with open(work / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                [str(BIN / "prefect"), "worker", "start", "--pool", "sandflow-process", "--type", "process"],
                env=worker_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        with stopped_at_exit(worker):
            yield dict(env, WORKER_LOG=str(work / "worker.log"), SERVER_LOG=str(work / "server.log"))


def _deployment(env: dict[str, str]) -> dict[str, Any]:
    (dep,) = [d for d in api(env, "/deployments/filter", {}) if d["name"] == "nightly"]
    return dep


def _run_deployment(env: dict[str, str], params: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
    """`prefect deployment run sandflow-nightly/nightly --params ...` (now, not at its cron),
    then wait until the worker has run it to a final state; the flow run."""
    r = prefect(env, "deployment", "run", "sandflow-nightly/nightly", "--params", json.dumps(params))
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", r.stdout)
    assert m, r.stdout
    run: dict[str, Any] = {"id": m.group(1), "state_type": None}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = api(env, f"/flow_runs/{run['id']}")
        if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(1)
    pytest.fail(f"the deployment run did not end in {timeout_s:.0f} s: {run['state_type']}\n"
                f"{Path(env['WORKER_LOG']).read_text()[-3000:]}")  # fmt: skip


def _params(tmp_path: Path, model: ScriptedModel, rid: str, n: int, **kw: Any) -> dict[str, Any]:
    tasks = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(n))
    return {
        "source": str(tasks), "base_url": model.url, "model": "scripted", "max_steps": 6,
        "warehouse": str(tmp_path / "wh"), "run_id": rid, "viewer_url": None, **kw,
    }  # fmt: skip


def _ended_well(env: dict[str, str], run: dict[str, Any]) -> None:
    assert run["state_type"] == "COMPLETED", (
        f"{run['state_type']}: {run['state'].get('message')}\n{Path(env['WORKER_LOG']).read_text()[-3000:]}"
    )


class _Sampler:
    """Every 0.2 s during a run: the run's live sandboxes (by label) on each engine and the
    processes and engines that opened them, the global limits' active slots, the model
    calls in flight."""

    def __init__(
        self, env: dict[str, str], rid: str, in_flight: list[int], engines: dict[str, str] | None = None
    ) -> None:
        self.env, self.rid, self.in_flight = env, rid, in_flight
        self.engines = engines or {"first": FIRST_ENGINE}
        self.live: list[int] = []  # on all engines together
        self.owners: set[str] = set()
        self.engines_used: set[str] = set()
        self.slots: dict[str, list[int]] = {"sandflow-sandboxes": [], "sandflow-model-calls": []}
        self.model_calls: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import docker

        clients = {name: docker.DockerClient(base_url=host, timeout=20) for name, host in self.engines.items()}
        while not self._stop.is_set():
            live = 0
            for name, client in clients.items():
                found = client.containers.list(filters={"label": f"sandflow.run_id={self.rid}"})
                live += len(found)
                self.owners |= {c.labels.get("sandflow.pid", "") for c in found}
                if found:
                    self.engines_used.add(name)
            self.live.append(live)
            with contextlib.suppress(Exception):
                for lim in api(self.env, "/v2/concurrency_limits/filter", {}):
                    if lim["name"] in self.slots:
                        self.slots[lim["name"]].append(lim["active_slots"])
            self.model_calls.append(self.in_flight[0])
            self._stop.wait(0.2)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def counting_solver(in_flight: list[int]) -> Any:
    """The flows' solver, 0.2 s per reply (calls of several episodes would overlap), counting
    the calls in flight: in_flight = [now, most]."""
    lock = threading.Lock()

    def reply(body: dict, index: int) -> Reply:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            time.sleep(0.2)
            return solver(body, index)
        finally:
            with lock:
                in_flight[0] -= 1

    return reply


def _assert_limits_held(sampled: _Sampler, in_flight: list[int]) -> None:
    """Reached, never passed (live sandboxes, active slots, model calls), while two worker
    processes other than this one held sandboxes."""
    assert max(sampled.live) == SANDBOX_LIMIT, sampled.live
    assert max(sampled.slots["sandflow-sandboxes"]) == SANDBOX_LIMIT, sampled.slots
    assert max(sampled.slots["sandflow-model-calls"]) <= MODEL_LIMIT, sampled.slots
    assert in_flight[1] == MODEL_LIMIT, in_flight  # never two model calls at once
    owners = sampled.owners - {""}
    assert len(owners) == 2 and str(os.getpid()) not in owners, owners


def _submitted(wh: Path, rid: str) -> int:
    from warehouse.query import connect

    with connect(wh) as q:
        row = q.con.execute(
            f"SELECT count(*) FROM episodes WHERE run_id = '{rid}' AND termination = 'submitted'"
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_triggered_nightly_run_on_two_engines_keeps_the_global_limits_and_publishes_its_report(
    server: dict[str, str], database: str, second_engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The nightly deployment run now on an external Dask cluster whose two workers open their
    sandboxes each on its own Docker engine (tests/two_engines.py, scripts/engine2.sh): the
    limits are the server's, so they hold across both engines together; the run writes its
    report and publishes its artifacts."""
    from tests.two_engines import dask_cluster

    engines = {"first": FIRST_ENGINE, "second": second_engine}
    in_flight = [0, 0]
    rid = f"pytest-pg-2e-{uuid.uuid4().hex[:6]}"
    # the workers take this process's environment: the server's API is their global limits
    monkeypatch.setenv("PREFECT_API_URL", server["PREFECT_API_URL"])
    with (
        dask_cluster(tmp_path / "dask", {"w1": engines["first"], "w2": engines["second"]}, nthreads=3) as cluster,
        ScriptedModel(default=counting_solver(in_flight), models=("scripted",)) as model,
    ):
        params = _params(tmp_path, model, rid, 6, mode="sandbox", concurrency=6, task_runner="dask",
                         dask_address=cluster.address)  # fmt: skip
        with _Sampler(server, rid, in_flight, engines) as sampled:
            run = _run_deployment(server, params)
    _ended_well(server, run)
    dep = _deployment(server)
    assert run["deployment_id"] == dep["id"] and run["parameters"]["run_id"] == rid
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["0 2 * * *"]  # the cron is kept
    assert _submitted(tmp_path / "wh", rid) == 6
    _assert_limits_held(sampled, in_flight)
    assert sampled.engines_used == set(engines), sampled.engines_used  # sandboxes on both engines
    from tests.two_engines import containers_on

    assert containers_on(engines["first"], rid) == [] and containers_on(engines["second"], rid) == []
    # the report, on disk and as Prefect artifacts read back through the API
    report = tmp_path / "wh" / "reports" / rid
    assert (report / "report.html").stat().st_size > 0
    assert "accuracy" in (report / "report.md").read_text().lower()
    from flows.artifacts import artifact_key

    keys = {k: artifact_key(k, rid) for k in ("report", "accuracy", "tokens", "terminations")}
    arts = api(server, "/artifacts/filter", {"artifacts": {"key": {"any_": list(keys.values())}}})
    by_key = {a["key"]: a for a in arts}
    assert set(by_key) == set(keys.values()), sorted(by_key)
    assert by_key[keys["report"]]["type"] == "markdown" and rid in by_key[keys["report"]]["data"]
    assert by_key[keys["accuracy"]]["type"] == "table"
    # the server's record is in PostgreSQL, not in a SQLite file of its PREFECT_HOME
    rows = asyncio.run(_fetch(database, f"SELECT count(*) FROM artifact WHERE key = '{keys['report']}'"))
    assert rows[0][0] >= 1
    assert not list(Path(server["PREFECT_HOME"]).glob("*.db"))
