"""The owner's watchdog: what a kill -9 of the process that opened sandboxes leaves, it removes.

A docker sandbox removes itself when its owner's connection drops (StdinOnce + AutoRemove),
but only once it has *started*: a container created and not yet started when the owner
died stays in state `Created` for good, because auto-remove fires only when a started
container exits. No ordering of engine calls closes that window (create and start are two
calls), so something outside the owner has to notice the death.

That is this process. The first sandbox a process opens starts one watchdog per engine
(`python -m sandbox.reaper`), in its own session (a kill of the owner's process group
spares it), holding the read end of a pipe whose write end only the owner holds. When the
owner dies, however it dies, the pipe ends; the watchdog then removes every sandflow
container labelled with the owner's pid, pid start time and host (any state: `Created`
ones included; netns holders too), and the owner's bubblewrap leftovers (cgroups, state
files). It sweeps again over the next half minute to catch a create the engine was still
processing when the owner died, then exits. It imports nothing heavy until the owner is
gone, so an idle watchdog costs one sleeping process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import subprocess
import sys
import threading
import time

SWEEPS_AT_S = (0.0, 1.0, 3.0, 7.0, 15.0, 30.0)  # after the owner's death
POLL_S = 5.0  # the pipe can outlive the owner in a fork()ed child: check the pid too

_LOCK = threading.Lock()
_STARTED: dict[tuple[int, str], subprocess.Popen[bytes]] = {}  # (our pid, engine) -> watchdog


def ensure_started(*, docker: bool, docker_host: str | None = None) -> None:
    """Start this process's watchdog, once per engine (docker=False: bubblewrap only).

    `docker_host` None is the default engine (DOCKER_HOST or the local socket).
    """
    from sandbox import labels as L

    key = (os.getpid(), f"docker:{docker_host or ''}" if docker else "bwrap")
    with _LOCK:
        proc = _STARTED.get(key)
        if proc is not None and proc.poll() is None:
            return
        start = L.process_start(os.getpid()) or ""
        argv = [sys.executable, "-m", "sandbox.reaper", "--pid", str(os.getpid())]
        argv += ["--pid-start", start, "--host", _hostname()]
        if docker:
            from sandbox.bulk import base_dir

            argv += ["--docker"] + (["--docker-host", docker_host] if docker_host else [])
            argv += ["--bulk-base", base_dir()]  # where our BulkDirs are, whatever its env
        r, w = os.pipe()  # both ends non-inheritable: only the watchdog gets r (as stdin)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                cwd=_package_root(),
            )
        finally:
            os.close(r)
        _WRITE_ENDS.append(w)  # never written, never closed: it ends when we do
        _STARTED[key] = proc


_WRITE_ENDS: list[int] = []


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _owner_alive(pid: int, start: str) -> bool:
    """The owner runs: its pid exists with the same start time and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    if fields[0] in (b"Z", b"X"):  # killed, not yet reaped by its parent
        return False
    return not start or fields[19].decode() == start


def wait_for_owner(pid: int, start: str) -> None:
    """Block until the owner is gone: its pipe ends (or, polled, its pid is gone/reused).

    The pipe ending is taken as death only once the pid agrees: an owner that closed the
    descriptor by accident (a closerange of its own) must not lose its live sandboxes.
    """
    pipe_open = True
    while True:
        if pipe_open:
            r, _, _ = select.select([0], [], [], POLL_S)
            if r:
                try:
                    pipe_open = bool(os.read(0, 4096))
                except OSError:
                    pipe_open = False
                if pipe_open:
                    continue
        else:
            time.sleep(POLL_S / 10)
        if not _owner_alive(pid, start):
            return


def _mine(labels: dict[str, str], pid: int, start: str, host: str) -> bool:
    from sandbox import labels as L

    return (
        labels.get(L.PID) == str(pid)
        and labels.get(L.PID_START, "") == start
        and labels.get(L.HOST) == host
    )


def sweep(
    pid: int,
    start: str,
    host: str,
    docker: bool,
    docker_host: str | None,
    bulk_base: str | None = None,
) -> int:
    """Remove every sandbox (and holder) of the dead owner; how many were removed."""
    from sandbox import gc as G
    from sandbox import labels as L

    removed = 0
    if docker:
        from sandbox.engine import docker_client

        client = docker_client(docker_host)
        found = client.api.containers(all=True, filters={"label": f"{L.PID}={pid}"})
        for c in found:
            labels = c.get("Labels") or {}
            if L.RUN_ID in labels and _mine(labels, pid, start, host):
                with contextlib.suppress(Exception):
                    G.remove_docker(
                        client, G.SandboxInfo("docker", c["Id"], c.get("State", "?"), labels)
                    )
                    removed += 1
        from sandbox.bulk import remove_leftovers

        remove_leftovers(pid, bulk_base)  # the fork side channels' (empty) folders
    for info in G.bwrap_sandboxes():
        if _mine(info.labels, pid, start, host):
            with contextlib.suppress(Exception):
                removed += int(G.remove_bwrap(info))
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="sandflow's watchdog (started by sandbox owners)")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--pid-start", default="")
    ap.add_argument("--host", required=True)
    ap.add_argument("--docker", action="store_true", help="sweep the docker engine too")
    ap.add_argument("--docker-host", default=None)
    ap.add_argument("--bulk-base", default=None, help="where the owner made its bulk folders")
    args = ap.parse_args(argv)
    wait_for_owner(args.pid, args.pid_start)
    t0 = time.monotonic()
    for at in SWEEPS_AT_S:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        with contextlib.suppress(Exception):  # engine down: the next sweep, or `sandbox gc`
            sweep(
                args.pid, args.pid_start, args.host, args.docker, args.docker_host, args.bulk_base
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
