"""kill -9 of the process that owns sandboxes leaves nothing, not even a `Created` container.

A docker sandbox is created, then attached, then started: two engine calls apart. A kill -9
between them used to leave the container in state `Created` for good (auto-remove fires
only when a started container exits). The owner's watchdog (sandbox/reaper.py) removes
it; here the window is held open on purpose (the owner's `start` call never returns), the
owner is killed in it, and nothing but the watchdog runs afterwards: no `sandbox gc`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos.conftest import bwrap_sandboxes_of, containers_of, wait_for

pytestmark = [pytest.mark.chaos]
REPO = Path(__file__).resolve().parents[2]

_STUCK_IN_CREATED = """
import sys, time
sys.path.insert(0, {repo!r})
import docker.api.client

start = docker.api.client.APIClient.start

def start_but_not_that_one(self, container, *args, **kwargs):
    labels = self.inspect_container(container)["Config"]["Labels"] or {{}}
    if labels.get("sandflow.role", "sandbox") == {stuck!r}:  # hold the create-start window open
        print("CREATED", container, flush=True)
        time.sleep(3600)
    return start(self, container, *args, **kwargs)

docker.api.client.APIClient.start = start_but_not_that_one
from sandbox import SandboxConfig, SandboxLimits, open_sandbox
open_sandbox(SandboxConfig(backend="docker", run_id={run_id!r}, episode_id="created",
                           limits=SandboxLimits(network={network!r})))
"""


def _owned_by(pid: int) -> list[tuple[str, str]]:
    """(container id, state) of every container labelled with `pid` as its owner."""
    from sandbox.engine import docker_client

    found = docker_client().api.containers(all=True, filters={"label": f"sandflow.pid={pid}"})
    return [(c["Id"], c["State"]) for c in found]


_OWNS_A_BWRAP_SANDBOX = """
import sys, time
sys.path.insert(0, {repo!r})
from sandbox import SandboxConfig, open_sandbox
sb = open_sandbox(SandboxConfig(backend="bwrap", run_id={run_id!r}, episode_id="owned"))
print("OPEN", [str(d) for d in (sb.cgroups.dirs.values() if sb.cgroups else [])], flush=True)
time.sleep(3600)
"""


def _owner(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.parametrize(
    ("network", "stuck"),
    [("host", "sandbox"), ("none", "sandbox"), ("none", "netns-holder")],
    ids=["sandbox", "sandbox-in-pooled-netns", "netns-holder"],
)
def test_kill9_between_create_and_start_leaves_no_created_container(
    sandbox_image: str, test_run_id: str, network: str, stuck: str
) -> None:
    run_id = f"{test_run_id}-created-{stuck}-{network}"
    code = _STUCK_IN_CREATED.format(repo=str(REPO), run_id=run_id, network=network, stuck=stuck)
    owner = _owner(code)
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline().split()
        assert line[:1] == ["CREATED"], f"the owner never reached the window: {line}"
        held = line[1]
        # The window is real: a container nobody will start (auto-remove cannot fire).
        assert (held, "created") in _owned_by(owner.pid)
        os.killpg(owner.pid, signal.SIGKILL)  # the owner's whole process group
        # Not reaped yet: the owner stays a zombie meanwhile, which is dead all the same.
        wait_for(lambda: _owned_by(owner.pid) == [], 60, "the owner's containers to be removed")
        assert containers_of(run_id) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait(timeout=10)


def test_kill9_of_a_bwrap_owner_leaves_no_cgroup_or_state(
    sandbox_rootfs: str, test_run_id: str
) -> None:
    run_id = f"{test_run_id}-bwrap-kill9"
    owner = _owner(_OWNS_A_BWRAP_SANDBOX.format(repo=str(REPO), run_id=run_id))
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.startswith("OPEN"), line
        cgroups = [Path(d) for d in eval(line[5:])]  # noqa: S307 - our own repr of a str list
        assert len(bwrap_sandboxes_of(run_id)) == 1
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        wait_for(lambda: bwrap_sandboxes_of(run_id) == [], 60, "the bwrap state file to be removed")
        wait_for(lambda: not any(d.exists() for d in cgroups), 30, "the cgroup dirs to be removed")
    finally:
        if owner.poll() is None:
            owner.kill()
