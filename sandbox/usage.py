"""What a sandbox used: CPU-seconds and peak memory, from its cgroup.

Why from the cgroup: the kernel counts every process of the sandbox there, including
those the model started in the background, and nothing inside the sandbox can change
the count (the helper's own reports could be forged by sandbox code). Docker on this host: the
container's cgroup files, found from its init process's /proc/PID/cgroup (a few reads,
~0.1 ms). The engine's stats API is the fallback (a remote engine, a cgroup not
readable here): even "one shot" waits for the engine's next collection tick, 0-1 s,
which cost a 10-turn episode ~2 s of its ~0.25 s (peak memory is `max_usage`, which
cgroup v2 engines do not report: None then). bwrap: the cgroup v1 files of its own
cgroups (root only; without them: None).

Every number is bounded before use (an int in [0, 2**62]); anything else reads as None,
"unknown", never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAX = 1 << 62


@dataclass(frozen=True)
class ResourceUsage:
    """CPU-seconds used and the peak memory in bytes; None: the backend cannot tell."""

    cpu_s: float | None = None
    peak_memory_bytes: int | None = None

    def since(self, start: ResourceUsage | None) -> ResourceUsage:
        """The CPU used since `start` (a pooled sandbox's earlier episodes left out); the
        peak is the sandbox's own (a pooled sandbox's: since it started, an upper bound)."""
        if start is None or start.cpu_s is None or self.cpu_s is None:
            return self
        return ResourceUsage(max(0.0, self.cpu_s - start.cpu_s), self.peak_memory_bytes)


def _bounded(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX:
        return value
    return None


def from_docker_stats(stats: Any) -> ResourceUsage:
    """The engine's one-shot stats (`api.stats(id, stream=False, one_shot=True)`)."""
    if not isinstance(stats, dict):
        return ResourceUsage()
    cpu = stats.get("cpu_stats")
    usage = cpu.get("cpu_usage") if isinstance(cpu, dict) else None
    total_ns = _bounded(usage.get("total_usage")) if isinstance(usage, dict) else None
    mem = stats.get("memory_stats")
    peak = _bounded(mem.get("max_usage")) if isinstance(mem, dict) else None
    return ResourceUsage(None if total_ns is None else total_ns / 1e9, peak)


def _read_int(path: Path) -> int | None:
    try:
        with path.open("rb") as f:
            text = f.read(32)  # a cgroup counter is one short line
        return _bounded(int(text.split()[0]))
    except (OSError, ValueError, IndexError):
        return None


CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_PROC_CGROUP_BYTES = 64 << 10  # /proc/PID/cgroup: one short line per hierarchy


def cgroup_dirs(pid: int, must_contain: str, root: Path = CGROUP_ROOT) -> dict[str, Path]:
    """The cgroup directories of process `pid` that CPU and memory are read from
    ("cpuacct" and "memory" for v1, "unified" for v2), keeping only paths that name
    `must_contain` (a container's id: a reused pid, or a pid of another host's engine,
    never matches). Empty when none is found or readable."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            text = f.read(MAX_PROC_CGROUP_BYTES).decode("utf-8", "replace")
    except OSError:
        return {}
    dirs: dict[str, Path] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not must_contain or must_contain not in parts[2]:
            continue
        hierarchy, controllers, rel = parts[0], parts[1], parts[2].lstrip("/")
        if hierarchy == "0" and not controllers:  # the v2 (unified) hierarchy
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            if (base / rel / "cpu.stat").exists():
                dirs["unified"] = base / rel
            continue
        for name in controllers.split(","):
            if name not in ("cpuacct", "memory"):
                continue
            for mount in (root / controllers, root / name):  # "cpu,cpuacct" or "cpuacct"
                if (mount / rel / "cgroup.procs").exists():
                    dirs[name] = mount / rel
                    break
    return dirs


def from_cgroup_dirs(dirs: dict[str, Path]) -> ResourceUsage:
    """CPU-seconds and peak memory from `cgroup_dirs`' directories (v1 first)."""
    if "cpuacct" in dirs or "memory" in dirs:
        return from_cgroup_v1(dirs.get("cpuacct"), dirs.get("memory"))
    unified = dirs.get("unified")
    if unified is None:
        return ResourceUsage()
    usec = None
    try:
        with (unified / "cpu.stat").open("rb") as f:
            for line in f.read(4096).decode("ascii", "replace").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    usec = _bounded(int(value)) if value.strip().isdigit() else None
    except OSError:
        pass
    peak = _read_int(unified / "memory.peak")  # kernels >= 5.19; older: None
    return ResourceUsage(None if usec is None else usec / 1e6, peak)


def from_cgroup_v1(cpuacct_dir: Path | None, memory_dir: Path | None) -> ResourceUsage:
    """cpuacct.usage (ns) and memory.max_usage_in_bytes of one sandbox's cgroups."""
    ns = _read_int(cpuacct_dir / "cpuacct.usage") if cpuacct_dir is not None else None
    peak = _read_int(memory_dir / "memory.max_usage_in_bytes") if memory_dir is not None else None
    return ResourceUsage(None if ns is None else ns / 1e9, peak)
