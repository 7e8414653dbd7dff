"""Labels, close() on every path, wall-clock lifetime, gc by label, signals."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from sandbox import Sandbox, SandboxClosed, SandboxConfig, SandboxExpired, open_sandbox
from sandbox import gc as G
from sandbox import labels as L

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _exists(sb: Sandbox) -> bool:
    """Does the sandbox still exist on its backend (container / bwrap process)?"""
    if sb.config.backend == "docker":
        import docker.errors

        try:
            sb.api.inspect_container(sb.container_id)  # type: ignore[attr-defined]
            return True
        except docker.errors.NotFound:
            return False
    return sb.proc.poll() is None  # type: ignore[attr-defined]


def _labels(sb: Sandbox) -> dict[str, str]:
    if sb.config.backend == "docker":
        return sb.api.inspect_container(sb.container_id)["Config"]["Labels"]  # type: ignore[attr-defined]
    return json.loads(sb.state_file.read_text())["labels"]  # type: ignore[attr-defined]


def test_labels_on_every_sandbox(box: Sandbox, test_run_id: str) -> None:
    labels = _labels(box)
    assert labels[L.RUN_ID] == test_run_id
    assert labels[L.EPISODE_ID] == "shared"
    assert labels[L.TTL_S] == str(box.config.ttl_s)
    born = datetime.fromisoformat(labels[L.CREATED_AT].replace("Z", "+00:00"))
    assert abs((datetime.now(UTC) - born).total_seconds()) < 3600
    assert labels[L.PID] == str(os.getpid()) and L.owner_state(labels) == "alive"


def test_close_removes_and_is_idempotent(make_config: Callable[..., SandboxConfig]) -> None:
    sb = open_sandbox(make_config("close"))
    assert _exists(sb)
    sb.close()
    assert not _exists(sb)
    if sb.config.backend == "docker":  # the workdir is a tmpfs: no volume is left behind
        label = f"{L.SANDBOX_ID}={sb.labels[L.SANDBOX_ID]}"  # type: ignore[attr-defined]
        assert not sb.api.volumes(filters={"label": label}).get("Volumes")  # type: ignore[attr-defined]
    else:
        assert not sb.state_file.exists()  # type: ignore[attr-defined]
    sb.close()
    with pytest.raises(SandboxClosed):
        sb.exec("true")


def test_close_on_exception(make_config: Callable[..., SandboxConfig]) -> None:
    holder: list[Sandbox] = []
    with (
        pytest.raises(RuntimeError, match="episode blew up"),
        open_sandbox(make_config("exc")) as sb,
    ):
        holder.append(sb)
        sb.exec("echo working")
        raise RuntimeError("episode blew up")
    assert not _exists(holder[0])


def test_wall_clock_limit(make_config: Callable[..., SandboxConfig]) -> None:
    sb = open_sandbox(make_config("wall", wall_clock_s=2))
    try:
        assert sb.exec("echo early").stdout == "early\n"
        r = sb.exec("sleep 30", timeout=20)
        assert r.timed_out and "wall-clock limit" in r.stderr
        with pytest.raises(SandboxExpired):
            sb.exec("true")
        assert not _exists(sb)
    finally:
        sb.close()


def test_other_sandboxes_carry_on_when_one_is_closed(
    box: Sandbox, make_config: Callable[..., SandboxConfig]
) -> None:
    a = open_sandbox(make_config("a"))
    b = open_sandbox(make_config("b"))
    a.close()
    assert b.exec("echo b").stdout == "b\n" and box.exec("echo shared").stdout == "shared\n"
    b.close()


_OWNER_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from sandbox import SandboxConfig, open_sandbox
sb = open_sandbox(SandboxConfig(backend={backend!r}, run_id={run_id!r}, episode_id="signal"))
print(sb.name, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_owner_death_removes_its_sandboxes(backend: str, test_run_id: str, sig: int) -> None:
    """SIGTERM/SIGINT: the handler removes them; SIGKILL: the sandbox ends itself."""
    run_id = f"{test_run_id}-sig{sig}"
    code = _OWNER_SCRIPT.format(repo=REPO, backend=backend, run_id=run_id)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name, "the owner process did not open its sandbox"
        assert len(_find(run_id)) == 1
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _find(run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _find(run_id) == [], (
            f"{backend} sandbox survived its owner's {signal.Signals(sig).name}"
        )
        if backend == "docker":  # its fork side channel's folder (sandbox/bulk.py) goes too
            left = os.path.join(tempfile.gettempdir(), f"sandflow-bulk-{proc.pid}-*")
            while glob.glob(left) and time.monotonic() < deadline + 15:
                time.sleep(0.2)
            assert glob.glob(left) == [], "the side channel's folder outlived its owner"
    finally:
        if proc.poll() is None:
            proc.kill()
        # What the engine may leave behind (a workdir volume) is gc's job, by label. The
        # engine may still be auto-removing the container ("removing"): give it time.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            G.collect(_client(), everything=True, run_prefix=run_id)
            if not G.list_all(_client(), run_id) and not G.orphan_volumes(_client(), run_id):
                break
            time.sleep(0.2)
        assert G.list_all(_client(), run_id) == [] and G.orphan_volumes(_client(), run_id) == []


def _client() -> object:
    from sandbox.engine import docker_client

    return docker_client()


def _find(run_id: str, running_only: bool = True) -> list[G.SandboxInfo]:
    found = [i for i in G.list_all(_client(), run_id) if i.run_id == run_id]
    return [i for i in found if i.status == "running"] if running_only else found


def test_gc_by_label_only(docker_engine: object, sandbox_image: str, test_run_id: str) -> None:
    """gc removes expired and orphaned sandflow containers, and never anything unlabelled."""
    api = docker_engine.api  # type: ignore[attr-defined]
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = (
        (datetime.now(UTC) - timedelta(hours=2))
        .isoformat(timespec="seconds")
        .replace("+00:00", "Z")
    )
    base = {
        L.RUN_ID: f"{test_run_id}-gc",
        L.CREATED_AT: L.make_labels(SandboxConfig(), "docker")[L.CREATED_AT],
    }
    specs = {
        "expired": {**base, L.EPISODE_ID: "expired", L.CREATED_AT: old, L.TTL_S: "60"},
        "orphan": {
            **base,
            L.EPISODE_ID: "orphan",
            L.TTL_S: "3600",
            L.HOST: L.make_labels(SandboxConfig(), "docker")[L.HOST],
            L.PID: str(dead.pid),
        },
        "live": {
            **L.make_labels(SandboxConfig(run_id=f"{test_run_id}-gc", episode_id="live"), "docker")
        },
        "stranger": {"com.example.owner": "someone-else"},  # same image, no sandflow label
    }
    ids = {}
    try:
        for name, labels in specs.items():
            c = api.create_container(
                sandbox_image,
                ["sleep", "300"],
                labels=labels,
                user="1000:1000",
                host_config=api.create_host_config(network_mode="none"),
            )
            api.start(c["Id"])
            ids[name] = c["Id"]
        planned = {
            i.episode_id: why
            for i, why in G.collect(docker_engine, dry_run=True, run_prefix=f"{test_run_id}-gc")
        }
        assert set(planned) == {"expired", "orphan"}
        assert "ttl" in planned["expired"] and "gone" in planned["orphan"]
        running = {c["Id"] for c in api.containers()}
        assert set(ids.values()) <= running, "--dry-run must not remove anything"
        G.collect(docker_engine, run_prefix=f"{test_run_id}-gc")
        running = {c["Id"] for c in api.containers(all=True)}
        assert ids["expired"] not in running and ids["orphan"] not in running
        assert ids["live"] in running and ids["stranger"] in running
        # --all removes every sandflow container (of this prefix here), never the stranger
        G.collect(docker_engine, everything=True, run_prefix=f"{test_run_id}-gc")
        running = {c["Id"] for c in api.containers(all=True)}
        assert ids["live"] not in running and ids["stranger"] in running
    finally:
        for cid in ids.values():
            with contextlib.suppress(Exception):
                api.remove_container(cid, force=True)


def test_docker_host_can_be_given_explicitly(sandbox_image: str, test_run_id: str) -> None:
    config = SandboxConfig(
        run_id=test_run_id,
        episode_id="remote",
        docker_host=os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"),
    )
    with open_sandbox(config) as sb:
        assert sb.exec("echo via explicit host").stdout == "via explicit host\n"


def test_missing_image_fails_clearly(backend: str, test_run_id: str) -> None:
    from sandbox import SandboxError

    image = "sandflow/does-not-exist:0" if backend == "docker" else "/nonexistent/rootfs"
    with pytest.raises(SandboxError, match="sandflow image build"):
        open_sandbox(SandboxConfig(backend=backend, image=image, run_id=test_run_id))  # type: ignore[arg-type]
