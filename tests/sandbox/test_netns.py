"""Reused network namespaces (sandbox/netns.py) on the real Docker engine.

Network policy "none" sandboxes join a pooled holder's namespace. These tests hold the
isolation promises: live sandboxes never share a namespace; what a sandbox left listening
is gone for the next one in the same namespace; "none" is still only `lo`; holders are
locked down, replaced when dead, reaped when idle, and die with their owner.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sandbox import SandboxConfig, SandboxLimits, netns, open_sandbox
from sandbox import gc as G
from sandbox import labels as L
from sandbox.docker_backend import DockerSandbox

from .test_lifecycle import REPO

PORT = 8765
ABSTRACT = "sandflow-netns-test"


@pytest.fixture
def open_docker(sandbox_image: str, test_run_id: str) -> Iterator[Callable[..., DockerSandbox]]:
    opened: list[DockerSandbox] = []

    def open_(episode: str = "netns", network: str = "none") -> DockerSandbox:
        config = SandboxConfig(
            run_id=test_run_id,
            episode_id=episode,
            limits=SandboxLimits(memory_mb=256, pids=64, tmp_size_mb=64, network=network),  # type: ignore[arg-type]
        )
        sb = open_sandbox(config)
        assert isinstance(sb, DockerSandbox)
        opened.append(sb)
        return sb

    yield open_
    for sb in opened:
        sb.close()


def _netns(sb: DockerSandbox) -> str:
    r = sb.exec("readlink /proc/self/ns/net")
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def _holder_id(sb: DockerSandbox) -> str:
    holder = sb._holder
    assert holder is not None, "a network=none docker sandbox should join a holder"
    return holder.id


def _exists(api: Any, cid: str) -> bool:
    import docker.errors

    try:
        api.inspect_container(cid)
        return True
    except docker.errors.NotFound:
        return False


def _connect(port: int) -> str:
    """A shell command printing what connecting to 127.0.0.1:port gives."""
    return (
        "python3 -c 'import socket; s=socket.socket(); s.settimeout(2)\n"
        f"try:\n    s.connect((\"127.0.0.1\", {port})); print(\"connected\")\n"
        "except OSError as e:\n    print(type(e).__name__)'"
    )


def test_live_sandboxes_never_share_a_namespace(open_docker: Callable[..., DockerSandbox]) -> None:
    boxes = [open_docker(f"live-{i}") for i in range(3)]
    assert len({_holder_id(b) for b in boxes}) == 3
    assert len({_netns(b) for b in boxes}) == 3
    a, b = boxes[0], boxes[1]
    a.exec(f"nohup python3 -m http.server {PORT} --bind 127.0.0.1 >/dev/null 2>&1 &")
    deadline = time.monotonic() + 20
    while a.exec(_connect(PORT)).stdout.strip() != "connected":
        assert time.monotonic() < deadline, "the listener in A never came up"
        time.sleep(0.2)
    assert b.exec(_connect(PORT)).stdout.strip() == "ConnectionRefusedError"


def test_next_sandbox_in_a_reused_namespace_finds_nothing_left(
    open_docker: Callable[..., DockerSandbox],
) -> None:
    a = open_docker("left-a")
    ns_a, holder_a = _netns(a), _holder_id(a)
    listen = (
        "nohup python3 -c 'import socket, time\n"
        f"t = socket.socket(); t.bind((\"127.0.0.1\", {PORT})); t.listen()\n"
        f"u = socket.socket(socket.AF_UNIX); u.bind(\"\\0{ABSTRACT}\"); u.listen()\n"
        "time.sleep(600)' >/dev/null 2>&1 &"
    )
    a.exec(listen)
    deadline = time.monotonic() + 20
    while a.exec(_connect(PORT)).stdout.strip() != "connected":
        assert time.monotonic() < deadline, "the listener in A never came up"
        time.sleep(0.2)
    assert f"@{ABSTRACT}" in a.exec("cat /proc/net/unix").stdout
    a.close()

    b = open_docker("left-b")
    assert _holder_id(b) == holder_a, "the freed holder should be reused (most recent first)"
    assert _netns(b) == ns_a
    assert b.exec(_connect(PORT)).stdout.strip() == "ConnectionRefusedError"
    assert f"@{ABSTRACT}" not in b.exec("cat /proc/net/unix").stdout
    r = b.exec(
        "python3 -c 'import socket; u=socket.socket(socket.AF_UNIX)\n"
        f"try:\n    u.connect(\"\\0{ABSTRACT}\"); print(\"connected\")\n"
        "except OSError as e:\n    print(type(e).__name__)'"
    )
    assert r.stdout.strip() == "ConnectionRefusedError"
    # nothing of A's processes either: B's pid namespace holds only B's helper and shell
    assert "http.server" not in b.exec("ps -eo args 2>/dev/null || cat /proc/*/cmdline").stdout


def test_none_is_still_only_loopback(open_docker: Callable[..., DockerSandbox]) -> None:
    sb = open_docker("only-lo")
    assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]
    r = sb.exec(
        "python3 -c 'import socket; s=socket.socket(); s.settimeout(3)\n"
        "try:\n    s.connect((\"1.1.1.1\", 80)); print(\"connected\")\n"
        "except OSError as e:\n    print(type(e).__name__)'"
    )
    assert r.stdout.strip() in ("OSError", "TimeoutError") and "connected" not in r.stdout
    assert sb.exec("hostname").stdout.strip() == "sandbox"
    # the namespace's files are the holder's and shared by every sandbox that joins it
    for path in ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf"):
        assert sb.exec(f"echo x >> {path}").exit_code != 0, f"{path} is writable"


def test_holder_is_locked_down_and_labelled(open_docker: Callable[..., DockerSandbox]) -> None:
    import os

    sb = open_docker("locked")
    info = sb.api.inspect_container(_holder_id(sb))
    cfg, host = info["Config"], info["HostConfig"]
    assert cfg["Cmd"] == netns.HOLDER_ARGV and cfg["User"] == f"{netns.HOLDER_UID}:{netns.HOLDER_UID}"
    assert netns.HOLDER_UID >= 2_000_000_000  # no host account
    assert cfg["Hostname"] == "sandbox" and cfg["StdinOnce"] and cfg["OpenStdin"]
    assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"]
    assert host["SecurityOpt"] == ["no-new-privileges"] and host["NetworkMode"] == "none"
    assert 0 < host["PidsLimit"] <= 16 and 0 < host["Memory"] <= 64 * 2**20
    assert host["AutoRemove"]
    labels = cfg["Labels"]
    assert labels[L.RUN_ID] == netns.HOLDER_RUN_ID and labels[netns.ROLE] == "netns-holder"
    assert labels[L.PID] == str(os.getpid()) and L.owner_state(labels) == "alive"
    mode = sb.api.inspect_container(sb.container_id)["HostConfig"]["NetworkMode"]
    assert mode == f"container:{_holder_id(sb)}"


def test_other_policies_and_the_switch_keep_their_own_namespace(
    open_docker: Callable[..., DockerSandbox], host_settings: Callable[..., object]
) -> None:
    host = open_docker("host", network="host")
    assert host._holder is None
    assert host.api.inspect_container(host.container_id)["HostConfig"]["NetworkMode"] == "host"
    host_settings(netns_reuse=False)  # SANDFLOW_NETNS_REUSE=0, handed in by the application
    off = open_docker("switch-off")
    assert off._holder is None
    assert off.api.inspect_container(off.container_id)["HostConfig"]["NetworkMode"] == "none"
    assert off.exec("ls /sys/class/net").stdout.split() == ["lo"]
    assert off.exec("hostname").stdout.strip() == "sandbox"


def test_bridge_keeps_its_own_namespace(open_docker: Callable[..., DockerSandbox]) -> None:
    from sandbox.base import SandboxError

    try:
        sb = open_docker("bridge", network="bridge")
    except SandboxError as e:
        pytest.skip(f"this engine has no usable bridge: {e}")
    assert sb._holder is None
    assert sb.api.inspect_container(sb.container_id)["HostConfig"]["NetworkMode"] == "bridge"
    assert "eth0" in sb.exec("ls /sys/class/net").stdout.split()


@pytest.mark.parametrize("how", ["removed", "killed"])
def test_a_dead_holder_is_replaced_transparently(
    open_docker: Callable[..., DockerSandbox], how: str
) -> None:
    a = open_docker("dead-a")
    dead = _holder_id(a)
    a.close()
    if how == "removed":
        a.api.remove_container(dead, force=True)
    else:
        a.api.kill(dead)  # auto-remove may still be running when b starts
    b = open_docker("dead-b")
    assert _holder_id(b) != dead
    assert b.exec("echo alive").stdout == "alive\n"
    assert b.exec("ls /sys/class/net").stdout.split() == ["lo"]
    deadline = time.monotonic() + 20
    while _exists(b.api, dead) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _exists(b.api, dead)


def test_all_idle_holders_dead_costs_one_retry(open_docker: Callable[..., DockerSandbox]) -> None:
    """As after an engine restart: every idle holder is gone; the next start still works."""
    boxes = [open_docker(f"restart-{i}") for i in range(3)]
    dead = [_holder_id(b) for b in boxes]
    for b in boxes:
        b.close()
    api = boxes[0].api
    for hid in dead:
        api.remove_container(hid, force=True)
    pool = netns.pool_for(api, boxes[0].image)
    sb = open_docker("restart-next")
    assert _holder_id(sb) not in dead and sb.exec("echo ok").stdout == "ok\n"
    with pool._lock:
        idle = [h.id for h in pool._free]
    assert not set(idle) & set(dead), "dead idle holders should have been pruned"


def test_a_sandbox_removed_from_outside_still_frees_its_holder(
    open_docker: Callable[..., DockerSandbox],
) -> None:
    a = open_docker("outside-a")
    holder = _holder_id(a)
    a.api.remove_container(a.container_id, force=True)
    a.close()
    idle, _ = netns.pool_for(a.api, a.image).counts()
    assert idle >= 1
    b = open_docker("outside-b")
    assert _holder_id(b) == holder


def test_idle_holders_are_removed(
    open_docker: Callable[..., DockerSandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(netns, "IDLE_S", 0.5)
    a = open_docker("idle")
    holder = _holder_id(a)
    a.close()
    deadline = time.monotonic() + 30  # a reaper started earlier may be mid-sleep
    while _exists(a.api, holder) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _exists(a.api, holder)
    assert netns.pool_for(a.api, a.image).counts()[0] == 0


_OWNER = """
import sys, time
sys.path.insert(0, {repo!r})
from sandbox import SandboxConfig, open_sandbox
sb = open_sandbox(SandboxConfig(run_id={run_id!r}, episode_id="owner"))
print(sb._holder.id, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_holders_go_with_their_owner(sandbox_image: str, test_run_id: str, sig: int) -> None:
    """SIGTERM: the registry's handler removes them; SIGKILL: `cat` sees stdin EOF."""
    from sandbox.engine import docker_client

    api = docker_client().api
    code = _OWNER.format(repo=REPO, run_id=f"{test_run_id}-owner{int(sig)}")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    holder = ""
    try:
        assert proc.stdout is not None
        holder = proc.stdout.readline().strip()
        assert holder and _exists(api, holder)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _exists(api, holder) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _exists(api, holder), f"holder survived its owner's {signal.Signals(sig).name}"
    finally:
        if proc.poll() is None:
            proc.kill()
        if holder and _exists(api, holder):
            api.remove_container(holder, force=True)


def test_gc_removes_holders_of_a_gone_owner(docker_engine: Any, sandbox_image: str) -> None:
    """A holder whose owner is gone (pid label of an exited process) is garbage."""
    pool = netns.HolderPool(docker_engine.api, sandbox_image)
    holder = pool.acquire()
    try:
        info = [i for i in G.docker_sandboxes(docker_engine, netns.HOLDER_RUN_ID) if i.id == holder.id]
        assert len(info) == 1 and info[0].garbage_reason() is None  # our own: alive
        info[0].labels[L.PID_START] = "1"  # as if the pid now belonged to another process
        assert info[0].garbage_reason() is not None
    finally:
        pool.discard(holder)
    assert not _exists(docker_engine.api, holder.id)
