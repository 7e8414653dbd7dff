"""Two Docker engines and a Dask cluster of real processes, standing in for two hosts.

Used by tests/flows/test_two_engines.py and benchmarks/two_engines.py (issue #26):

- `engine2(verb)` runs scripts/engine2.sh (start | stop | halt | status): a second
  dockerd beside the machine's engine, with its own socket, roots, bridge and no iptables;
- `DaskCluster` runs `dask scheduler` and `dask worker` as processes of their own (each
  worker under its nanny, in its own session, with DOCKER_HOST naming its engine), so a
  test can kill -9 a worker (nanny and all: a host going down), restart it, and kill
  and restart the scheduler on the same address;
- `EngineWatch` follows both engines' container events for one run (which episode opened
  its sandbox on which engine) and samples their live sandboxes (the most at once).

Nothing here is a mock: the workers import this repository's code, open real sandboxes
on their own engine and write the one warehouse.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENGINE2_SCRIPT = REPO / "scripts" / "engine2.sh"
FIRST_ENGINE = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def engine2(verb: str, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """Run `scripts/engine2.sh VERB` (its SANDFLOW_ENGINE2_* settings in `env`); returns
    the DOCKER_HOST it prints (start, status)."""
    r = subprocess.run(
        ["bash", str(ENGINE2_SCRIPT), verb], env=dict(os.environ, **(env or {})),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"scripts/engine2.sh {verb} failed (exit {r.returncode}): {r.stderr[-2000:]}")
    lines = r.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def session_engine2_env(tag: str) -> dict[str, str]:
    """Settings for a second engine of this process alone (its own directory, bridge and
    /24), so that two test sessions on one machine never share or remove each other's."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    for third in [*range(os.getpid() % 200 + 20, 250), *range(20, 250)]:
        net = f"10.213.{third}."
        if f"{net}0/" not in routes:
            return {
                "SANDFLOW_ENGINE2_DIR": f"/var/tmp/sandflow-engine2-{tag}",
                "SANDFLOW_ENGINE2_BRIDGE": f"sfe2-{tag}"[:15],
                "SANDFLOW_ENGINE2_SUBNET": f"{net}1/24",
            }
    raise RuntimeError("no free /24 in 10.213.0.0/16 for a second engine's bridge")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Any, timeout: float, what: str, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


@dataclass
class _Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL to its whole session (a worker's nanny and its worker process)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # what SIGTERM left in its session


@dataclass
class DaskCluster:
    """A scheduler on 127.0.0.1:<port> and named workers, each bound to one engine."""

    logs: Path
    port: int = field(default_factory=free_port)
    scheduler: _Proc | None = None
    workers: dict[str, _Proc] = field(default_factory=dict)
    engines: dict[str, str] = field(default_factory=dict)  # worker name -> DOCKER_HOST

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _env(self, docker_host: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # On CPython 3.11 Dask's stack profiler can deadlock a busy worker (flows/prefect_env.py)
        env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"
        # a worker that lost its scheduler waits this long for it to come back, then exits
        env.setdefault("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "30s")
        if docker_host:
            env["DOCKER_HOST"] = docker_host
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> _Proc:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return _Proc(name, proc, log)

    def start_scheduler(self) -> None:
        argv = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"]
        self.scheduler = self._spawn("scheduler", argv, self._env())
        wait_until(self._scheduler_answers, 90, f"the Dask scheduler on {self.address} ({self.scheduler.log})", 0.3)

    def _scheduler_answers(self) -> bool:
        assert self.scheduler is not None
        if self.scheduler.proc.poll() is not None:
            raise RuntimeError(f"the Dask scheduler exited: {self.scheduler.log.read_text()[-1500:]}")
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def restart_scheduler(self) -> None:
        """kill -9 the scheduler, then start a new one on the same address."""
        assert self.scheduler is not None
        self.scheduler.kill()
        self.start_scheduler()

    def start_worker(self, name: str, docker_host: str, nthreads: int = 2, wait: bool = True) -> None:
        argv = [
            str(BIN / "dask"), "worker", self.address, "--name", name, "--nthreads", str(nthreads),
            "--nworkers", "1", "--host", "127.0.0.1", "--no-dashboard", "--death-timeout", "60",
            "--preload", "flows.dask_worker",  # closes the worker when its engine goes away
        ]  # fmt: skip
        self.workers[name] = self._spawn(name, argv, self._env(docker_host))
        self.engines[name] = docker_host
        if wait:
            self.wait_for_workers({name})

    def kill_worker(self, name: str) -> None:
        """kill -9 the worker and its nanny: the host is gone, as far as Dask can tell."""
        self.workers[name].kill()

    def live_workers(self) -> set[str]:
        """Names of the workers the scheduler knows now."""
        from distributed import Client

        with Client(self.address, timeout=20) as client:
            return {w["name"] for w in client.scheduler_info()["workers"].values()}

    def wait_for_workers(self, names: set[str], timeout: float = 120) -> None:
        def joined() -> bool:
            for n in names:
                if self.workers[n].proc.poll() is not None:
                    raise RuntimeError(f"Dask worker {n} exited: {self.workers[n].log.read_text()[-1500:]}")
            try:
                return names <= {str(n) for n in self.live_workers()}
            except OSError:
                return False

        wait_until(joined, timeout, f"Dask workers {sorted(names)} to join {self.address}", 0.5)

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        if self.scheduler is not None:
            self.scheduler.stop()


@contextlib.contextmanager
def dask_cluster(logs: Path, engines: dict[str, str], nthreads: int = 2) -> Iterator[DaskCluster]:
    """A scheduler and one worker per `engines` item (worker name -> DOCKER_HOST)."""
    logs.mkdir(parents=True, exist_ok=True)
    cluster = DaskCluster(logs)
    try:
        cluster.start_scheduler()
        for name, host in engines.items():
            cluster.start_worker(name, host, nthreads, wait=False)
        cluster.wait_for_workers(set(engines))
        yield cluster
    finally:
        cluster.close()


class EngineWatch:
    """Which engine opened each episode's sandbox, and the most sandboxes live at once.

    Follows each engine's container events (label sandflow.run_id=<run>) in a thread:
    `create` adds a live sandbox, `destroy` removes it; an engine that stops answering is
    followed again when it comes back. `episodes[engine]` holds the episode ids whose
    sandbox was created there; `last_engine[episode]` the engine of its latest attempt.
    """

    def __init__(self, engines: dict[str, str], run_id: str) -> None:
        self.engines = engines  # label -> DOCKER_HOST
        self.run_id = run_id
        self.lock = threading.Lock()
        self.live: dict[str, set[str]] = {e: set() for e in engines}
        self.max_live: dict[str, int] = dict.fromkeys(engines, 0)
        self.max_live_total = 0
        self.episodes: dict[str, set[str]] = {e: set() for e in engines}
        self.last_engine: dict[str, str] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._follow, args=(e,), daemon=True) for e in engines]

    def __enter__(self) -> EngineWatch:
        for t in self._threads:
            t.start()
        time.sleep(0.5)  # the event streams are open before the run starts
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def _follow(self, engine: str) -> None:
        import docker

        since = time.time() - 1
        while not self._stop.is_set():
            try:
                client = docker.DockerClient(base_url=self.engines[engine], timeout=10)
                stream = client.events(
                    decode=True, since=int(since), filters={"label": f"sandflow.run_id={self.run_id}", "type": "container"}
                )
                for ev in _until(stream, self._stop):
                    since = max(since, float(ev.get("time", since)))
                    self._event(engine, ev)
            except Exception:  # noqa: BLE001 - the engine stopped answering (a fault under test): follow again
                if self._stop.wait(0.5):
                    return
                with self.lock:
                    self.live[engine].clear()  # a stopped engine's containers are gone

    def _event(self, engine: str, ev: dict[str, Any]) -> None:
        attrs = ev.get("Actor", {}).get("Attributes", {})
        cid, action, ep = ev.get("id", ""), ev.get("Action", ""), attrs.get("sandflow.episode_id", "")
        with self.lock:
            if action == "create":
                self.live[engine].add(cid)
                if ep:
                    self.episodes[engine].add(ep)
                    self.last_engine[ep] = engine
            elif action == "destroy":
                self.live[engine].discard(cid)
            self.max_live[engine] = max(self.max_live[engine], len(self.live[engine]))
            self.max_live_total = max(self.max_live_total, sum(len(v) for v in self.live.values()))

    def live_on(self, engine: str) -> int:
        with self.lock:
            return len(self.live[engine])


def _until(stream: Any, stop: threading.Event) -> Iterator[dict[str, Any]]:
    """The events of a blocking stream until `stop` (the stream is closed from a timer)."""
    closer = threading.Thread(target=lambda: (stop.wait(), stream.close()), daemon=True)
    closer.start()
    yield from stream


def containers_on(docker_host: str, run_id: str) -> list[str]:
    """Names of the containers of `run_id` on that engine (any state)."""
    import docker

    client = docker.DockerClient(base_url=docker_host, timeout=30)
    found = client.containers.list(all=True, ignore_removed=True, filters={"label": f"sandflow.run_id={run_id}"})
    return [c.name for c in found]


def gc_run(docker_host: str, run_id: str) -> None:
    """`sandflow sandbox gc` for this run on that engine (containers that died with their engine)."""
    import docker

    from sandbox import gc as sandbox_gc

    sandbox_gc.collect(docker.DockerClient(base_url=docker_host, timeout=30), run_prefix=run_id)
