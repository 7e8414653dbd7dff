"""The infrastructure fails under a running flow: a container is killed, the engine restarts.

- A sandbox container killed from outside mid-episode (`docker kill`, found by its
  labels): the episode ends as `sandbox_error`, Prefect retries it as an infrastructure
  failure, the retry records it (once), and the other episodes finish untouched.
- The Docker engine restarted mid-run. Other people use this machine's engine, so the
  test starts a *private* dockerd (its own socket, data root, exec root, cgroup parent,
  no bridge), loads the sandbox image into it, points DOCKER_HOST at it, and kills
  and restarts that engine under a running flow, the way scripts/setup.sh starts one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import chaos_run_id, containers_of, query, wait_for
from tests.flows.conftest import run_kwargs, solver, tiny_tasks, write_tasks
from tests.scripted_model import Reply, ScriptedModel

pytestmark = [pytest.mark.chaos, pytest.mark.usefixtures("sandbox_image", "prefect_harness")]


def _task_of(body: dict) -> str:
    for m in body.get("messages", []):
        if m.get("role") == "user" and "Task t" in str(m.get("content")):
            text = str(m["content"])
            return text[text.index("Task t") + 5 :].split(":")[0]
    return "?"


def _thread_runner(n: int) -> Any:
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=n)


def test_container_killed_from_outside_is_retried_as_infra_failure(tmp_path: Path) -> None:
    from sandbox.engine import docker_client
    from tasks.records import episode_key

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(4))
    wh = tmp_path / "wh"
    rid = chaos_run_id("docker-kill")
    victim = episode_key(rid, "t1", "sandbox", 0)
    killed: list[str] = []
    client = docker_client()

    def kill_once(body: dict, index: int) -> Reply:
        """On t1's second turn (first attempt only), kill its container from outside."""
        turns_done = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        if _task_of(body) == "t1" and turns_done == 1 and not killed:
            for c in client.containers.list(ignore_removed=True, filters={"label": f"sandflow.episode_id={victim}"}):
                c.kill()
                killed.append(c.id)
        return solver(body, index)

    with ScriptedModel(default=kill_once, models=("scripted",)) as model:
        summary = run_flow_thread(ts, model, wh, rid, retries=2)
        calls = [_task_of(b) for b in model.requests]
    assert killed, "the fault was never injected"
    assert summary["failed"] == 0 and summary["succeeded"] == 4, summary
    rows = query(wh, f"SELECT task_id, termination, num_turns FROM episodes WHERE run_id = '{rid}' ORDER BY 1")
    assert rows == [(f"t{i}", "submitted", 4) for i in range(4)]
    dup = query(wh, f"SELECT episode_id FROM _raw_episodes WHERE run_id = '{rid}' GROUP BY 1 HAVING count(*) > 1")
    assert dup == []
    # t1 ran twice (the killed attempt, then the retry); every other task once (4 calls).
    assert calls.count("t1") > 4 and all(calls.count(f"t{i}") == 4 for i in (0, 2, 3)), calls
    assert containers_of(rid) == []


def run_flow_thread(ts: Path, model: ScriptedModel, wh: Path, rid: str, **kw: Any) -> dict[str, Any]:
    from flows.run import run_flow

    return run_flow.with_options(task_runner=_thread_runner(2))(
        **run_kwargs(ts, model, wh, run_id=rid, mode="sandbox", **kw)
    )


# ----------------------------------------------------------------------- engine restart
class PrivateEngine:
    """A dockerd of our own: restartable without touching anyone else's containers.

    It gets a bridge of its own: a dockerd started with `--bridge none` deletes the host's
    `docker0` at start (the shared engine then cannot start bridge-network containers).
    """

    BRIDGE = "sfchaos0"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock = root / "docker.sock"
        self.host = f"unix://{self.sock}"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        r = self.root
        return [
            "dockerd", "-H", self.host, "--data-root", str(r / "data"), "--exec-root", str(r / "exec"),
            "--pidfile", str(r / "docker.pid"), "--bridge", self.BRIDGE, "--iptables=false",
            "--ip-masq=false", "--cgroup-parent", "/sandflow-chaos-engine", "--storage-driver", "overlay2",
        ]  # fmt: skip

    def add_bridge(self) -> None:
        if subprocess.run(["ip", "link", "show", self.BRIDGE], capture_output=True).returncode:
            for cmd in (
                ["ip", "link", "add", self.BRIDGE, "type", "bridge"],
                ["ip", "addr", "add", "172.31.254.1/24", "dev", self.BRIDGE],
                ["ip", "link", "set", self.BRIDGE, "up"],
            ):
                subprocess.run(cmd, check=True, capture_output=True)

    def remove_bridge(self) -> None:
        subprocess.run(["ip", "link", "del", self.BRIDGE], capture_output=True)

    def start(self) -> None:
        self.add_bridge()
        self.clear_stale_containerd_pidfile()
        log = open(self.root / "dockerd.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_for(self.answers, 120, f"the private dockerd to answer (log {self.root / 'dockerd.log'})", poll=0.5)

    def clear_stale_containerd_pidfile(self) -> None:
        """Forget a containerd that died with its dockerd, so the new dockerd starts its own.

        dockerd starts its containerd with SIGKILL as parent-death signal: kill -9 of
        dockerd kills containerd too, which leaves a zombie until PID 1 reaps it. A
        restarted dockerd checks containerd.pid with kill(pid, 0), which succeeds for a
        zombie; it logs "containerd is still running" and waits on the dead socket until it
        gives up ("timeout waiting for containerd to start"). systemd reaps at once; this
        machine's PID 1 takes seconds, which is why the restart failed 3 times in 4. A
        pid file naming a zombie, a pid that is gone, or another program, is removed.
        """
        pidfile = self.root / "exec" / "containerd" / "containerd.pid"
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            state, comm = "gone", ""
        if state in ("gone", "Z", "X") or comm != "containerd":
            pidfile.unlink(missing_ok=True)

    def answers(self) -> bool:
        import docker

        try:
            docker.DockerClient(base_url=self.host, timeout=5).ping()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def kill(self) -> None:
        """kill -9 dockerd alone, as in a daemon crash (containerd dies with it: its parent-death
        signal; the containers' shims live on in their own sessions)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def kill_group(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill_group()  # containerd (and what an earlier kill left) go with the engine


@pytest.fixture(scope="module")
def private_engine(sandbox_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateEngine]:
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.fail("the engine-restart test needs dockerd and root", pytrace=False)
    root = Path("/var/tmp") / f"sandflow-chaos-engine-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    eng = PrivateEngine(root)
    eng.start()
    try:
        save = subprocess.Popen(["docker", "save", sandbox_image], stdout=subprocess.PIPE)
        load = subprocess.run(
            ["docker", "-H", eng.host, "load"], stdin=save.stdout, capture_output=True, timeout=600
        )
        save.wait(timeout=60)
        assert load.returncode == 0, load.stderr.decode()[-2000:]
        yield eng
    finally:
        eng.stop()
        # containerd shims outlive a killed engine (they run in their own sessions)
        for pid in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                if pid.isdigit() and str(root) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                    os.kill(int(pid), signal.SIGKILL)
        # dockerd bind-mounts its roots onto themselves and leaves nsfs mounts of the
        # containers that died with it: unmount everything under root, deepest first.
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(str(root))]
        for m in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)
        eng.remove_bridge()


def _assert_holder_pools_do_not_mix_engines(engine: PrivateEngine, image: str) -> None:
    """Regression check: network-namespace holder pools were once keyed by the SDK's
    `api.base_url`, which is "http+docker://localhost" for EVERY unix socket, so after any
    docker test in the same process the private engine got the host engine's holders and
    every sandbox start failed with 404. Pools are now keyed by the engine's socket."""
    import docker

    from sandbox import netns

    private = docker.APIClient(base_url=engine.host, timeout=20)
    pool = netns.pool_for(private, image)
    assert pool.api is private or pool.api.info().get("DockerRootDir") == private.info().get(
        "DockerRootDir"
    ), "the host engine's netns holder pool was handed out for the private engine"


@pytest.mark.slow
def test_engine_restart_mid_run(
    tmp_path: Path, private_engine: PrivateEngine, monkeypatch: pytest.MonkeyPatch, sandbox_image: str
) -> None:
    import docker

    monkeypatch.setenv("DOCKER_HOST", private_engine.host)
    _assert_holder_pools_do_not_mix_engines(private_engine, sandbox_image)
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(4))
    wh = tmp_path / "wh"
    rid = chaos_run_id("engine-restart")
    restarted = threading.Event()
    problems: list[str] = []

    def restart_engine() -> None:
        try:
            private_engine.kill()
            time.sleep(1.0)
            private_engine.start()
            restarted.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            log = (private_engine.root / "dockerd.log").read_text(errors="replace")[-1500:]
            problems.append(f"{type(exc).__name__}: {exc}\n{log}")

    def restart_once(body: dict, index: int) -> Reply:
        """When the 3rd request arrives, kill -9 the engine and start it again (background)."""
        if index == 2 and not restarted.is_set():
            threading.Thread(target=restart_engine, daemon=True).start()
            time.sleep(0.5)  # let the kill land while this episode's sandbox is in use
        return solver(body, index)

    with ScriptedModel(default=restart_once, models=("scripted",)) as model:
        summary = run_flow_thread(ts, model, wh, rid, retries=3)
        calls = [_task_of(b) for b in model.requests]
    wait_for(lambda: restarted.is_set() or problems, 150, "the engine restart to finish")
    assert restarted.is_set(), f"the engine did not come back: {problems}"
    # At least one episode was hit and ran again (4 turns per clean episode).
    assert len(calls) > 4 * 4, f"no episode was affected by the restart: {calls}"
    assert summary["failed"] == 0 and summary["succeeded"] == 4, summary
    rows = query(wh, f"SELECT termination, count(*) FROM episodes WHERE run_id = '{rid}' GROUP BY 1")
    assert rows == [("submitted", 4)]
    engine = docker.DockerClient(base_url=private_engine.host, timeout=20)
    left = engine.containers.list(ignore_removed=True, all=True, filters={"label": f"sandflow.run_id={rid}"})
    # Containers that died with the engine come back as 'exited' records; gc removes them.
    if left:
        from sandbox import gc as G

        G.collect(engine, run_prefix=rid)
        left = engine.containers.list(ignore_removed=True, all=True, filters={"label": f"sandflow.run_id={rid}"})
    assert left == [], [c.name for c in left]
