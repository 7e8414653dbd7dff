"""What a sandbox used: CPU-seconds and peak memory, from its cgroup.

Why from the cgroup: the kernel counts every process of the sandbox there, including
those the model started in the background, and nothing inside the sandbox can change
the count (the helper's own reports could be forged by sandbox code). Docker: the
engine's stats (one shot, ~10 ms; works for remote engines and both cgroup versions;
peak memory is `max_usage`, which cgroup v2 engines do not report: None then). bwrap:
the cgroup v1 files of its own cgroups (root only; without them: None).

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


def from_cgroup_v1(cpuacct_dir: Path | None, memory_dir: Path | None) -> ResourceUsage:
    """cpuacct.usage (ns) and memory.max_usage_in_bytes of one sandbox's cgroups."""
    ns = _read_int(cpuacct_dir / "cpuacct.usage") if cpuacct_dir is not None else None
    peak = _read_int(memory_dir / "memory.max_usage_in_bytes") if memory_dir is not None else None
    return ResourceUsage(None if ns is None else ns / 1e9, peak)
