"""Find and remove leaked sandboxes, by label only.

A sandbox is garbage when its TTL (label sandflow.ttl_s from sandflow.created_at) has
passed, or when the process that opened it is gone (labels sandflow.host, sandflow.pid,
sandflow.pid_start; checked only for sandboxes opened on this host). Containers without
the sandflow.run_id label are never looked at, whatever their image: the peer tool
removes every container of its image, including other people's.

bubblewrap sandboxes die with their owner (--die-with-parent); what can leak is their
cgroup directories and state files, which gc removes too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox import labels as L

BWRAP_STATE = "bwrap-state"


@dataclass
class SandboxInfo:
    backend: str
    id: str
    status: str
    labels: dict[str, str]

    @property
    def run_id(self) -> str:
        return self.labels.get(L.RUN_ID, "")

    @property
    def episode_id(self) -> str:
        return self.labels.get(L.EPISODE_ID, "")

    @property
    def age_s(self) -> float | None:
        return L.age_s(self.labels)

    @property
    def owner(self) -> str:
        return L.owner_state(self.labels)

    def garbage_reason(self, now: datetime | None = None) -> str | None:
        if L.ttl_passed(self.labels, now):
            return f"ttl {self.labels.get(L.TTL_S)}s passed"
        if self.owner == "gone":
            return f"owner pid {self.labels.get(L.PID)} is gone"
        if self.status in ("exited", "dead", "created") and self.owner != "alive":
            return f"container is {self.status}"
        return None


# ----------------------------------------------------------------------------- docker


def docker_sandboxes(client: Any, run_prefix: str | None = None) -> list[SandboxInfo]:
    """Every container labelled sandflow.run_id (optionally with a run id prefix)."""
    found = client.api.containers(all=True, filters={"label": L.RUN_ID})
    out = []
    for c in found:
        labels = c.get("Labels") or {}
        if run_prefix and not labels.get(L.RUN_ID, "").startswith(run_prefix):
            continue
        out.append(SandboxInfo("docker", c["Id"], c.get("State", "?"), labels))
    return out


def remove_docker(client: Any, info: SandboxInfo) -> None:
    import docker.errors

    try:
        client.api.remove_container(info.id, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code != 409:
            raise


def orphan_volumes(client: Any, run_prefix: str | None = None) -> list[SandboxInfo]:
    """Workdir volumes whose container is gone (the engine's auto-remove can leave them)."""
    found = client.api.volumes(filters={"dangling": True, "label": L.RUN_ID}).get("Volumes") or []
    out = []
    for v in found:
        labels = v.get("Labels") or {}
        if run_prefix and not labels.get(L.RUN_ID, "").startswith(run_prefix):
            continue
        out.append(SandboxInfo("docker-volume", v["Name"], "orphaned", labels))
    return out


def remove_volume(client: Any, info: SandboxInfo) -> None:
    import docker.errors

    try:
        client.api.remove_volume(info.id, force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code != 409:  # 409: in use again (cannot be ours, but never force it)
            raise


# ----------------------------------------------------------------------------- bwrap


def state_dir() -> Path:
    from sandbox.image import cache_dir

    return cache_dir() / BWRAP_STATE


def write_bwrap_state(
    sandbox_id: str,
    bwrap_pid: int,
    labels: dict[str, str],
    cgroups: list[str],
    *,
    volumes: str | None = None,
) -> Path:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{sandbox_id}.json"
    tmp = path.with_suffix(".tmp")
    state = {"pid": bwrap_pid, "labels": labels, "cgroups": cgroups, "volumes": volumes}
    tmp.write_text(json.dumps(state))
    tmp.replace(path)
    return path


def bwrap_sandboxes(run_prefix: str | None = None) -> list[SandboxInfo]:
    out: list[SandboxInfo] = []
    d = state_dir()
    if not d.is_dir():
        return out
    for path in sorted(d.glob("*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        labels = state.get("labels") or {}
        if run_prefix and not labels.get(L.RUN_ID, "").startswith(run_prefix):
            continue
        running = L.process_start(int(state.get("pid", 0))) is not None
        out.append(SandboxInfo("bwrap", path.stem, "running" if running else "exited", labels))
    return out


def remove_bwrap(info: SandboxInfo) -> bool:
    """Kill and remove a bwrap sandbox; False (state kept for a later try) if a cgroup stays busy."""
    path = state_dir() / f"{info.id}.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    pid = int(state.get("pid", 0))
    if pid and info.status == "running":  # bwrap: --die-with-parent takes the sandbox along
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    left = [cg for cg in state.get("cgroups", []) if not _remove_cgroup(Path(cg))]
    if isinstance(root := state.get("volumes"), str) and not _remove_volumes(root, info.id):
        left.append(root)
    if left:  # keep the state file: the next sweep or `sandflow sandbox gc` tries again
        return False
    path.unlink(missing_ok=True)
    return True


def _remove_volumes(root: str, sandbox_id: str) -> bool:
    """A dead bwrap sandbox's subvolumes and mounts (sandbox/volumes.py)."""
    from sandbox import volumes

    try:
        return volumes.for_root(Path(root)).remove_box(sandbox_id, within_s=5.0)
    except volumes.VolumesUnavailable:
        return True  # no btrfs mounted there any more: nothing of it is left
    except (OSError, ValueError):
        return False


def _remove_cgroup(cgdir: Path, within_s: float = 5.0) -> bool:
    """Kill what runs in a cgroup and remove it; True when it is gone.

    A SIGKILLed process leaves its cgroup only once the kernel has torn it down, so an
    rmdir right after the kill fails with EBUSY: keep killing and retrying for a moment.
    """
    deadline = time.monotonic() + within_s
    while True:
        try:
            for p in (cgdir / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(p), signal.SIGKILL)
        except OSError:
            pass
        try:
            cgdir.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


# ----------------------------------------------------------------------------- both


def list_all(client: Any | None, run_prefix: str | None = None) -> list[SandboxInfo]:
    found = bwrap_sandboxes(run_prefix)
    if client is not None:
        found = docker_sandboxes(client, run_prefix) + found
    return found


def collect(
    client: Any | None,
    *,
    dry_run: bool = False,
    everything: bool = False,
    run_prefix: str | None = None,
) -> list[tuple[SandboxInfo, str]]:
    """Remove garbage sandboxes (all of them with everything=True); returns (info, reason)."""
    now = datetime.now(UTC)
    removed = []
    for info in list_all(client, run_prefix):
        reason = "--all" if everything else info.garbage_reason(now)
        if reason is None:
            continue
        if not dry_run:
            if info.backend == "docker":
                remove_docker(client, info)
            elif not remove_bwrap(info):
                continue  # a cgroup still busy: its state stays, the next gc tries again
        removed.append((info, reason))
    if client is not None:
        for vol in orphan_volumes(client, run_prefix):
            if not dry_run:
                remove_volume(client, vol)
            removed.append((vol, "workdir volume without its container"))
    return removed


def collect_bulk(*, dry_run: bool = False, base: str | None = None) -> list[str]:
    """Remove the fork side channel folders (sandbox/bulk.py) whose owner process is gone,
    in `base` (None: this process's temp dir, where its runs make them); the paths."""
    import shutil

    from sandbox import bulk

    found = bulk.orphaned(base)
    if not dry_run:
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
    return found
