"""CPU-seconds and peak memory from the sandbox's cgroup (issue #28), on both backends:
the kernel's counts, which nothing inside the sandbox can change."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from sandbox import Sandbox
from sandbox.usage import ResourceUsage, cgroup_dirs, from_docker_stats

MB = 1 << 20
# ~0.3-1 s of one core's work and a 200 MiB allocation that is touched (counted as used)
WORK = "python3 -c \"x = bytearray(200 * 1024 * 1024); print(sum(range(30_000_000)), len(x))\""


def test_cpu_seconds_and_peak_memory_of_what_the_sandbox_ran(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh("usage")
    before = sb.resource_usage()  # type: ignore[attr-defined]
    assert before.cpu_s is not None and before.peak_memory_bytes is not None, before
    r = sb.exec(WORK, timeout=120)
    assert r.exit_code == 0, r.output
    after = sb.resource_usage()  # type: ignore[attr-defined]
    assert after.cpu_s is not None and after.peak_memory_bytes is not None
    assert after.cpu_s - before.cpu_s >= 0.2, (before, after)
    assert after.peak_memory_bytes >= 200 * MB, after
    assert after.peak_memory_bytes <= 512 * MB + 64 * MB  # the sandbox's memory limit bounds it


def test_a_new_episode_counts_its_own_cpu(fresh: Callable[..., Sandbox], make_config: Callable[..., object]) -> None:
    """A pooled sandbox serves episode after episode: each one's CPU starts at its begin."""
    sb = fresh("usage-pool")
    assert sb.exec(WORK, timeout=120).exit_code == 0
    spent = sb.resource_usage().cpu_s  # type: ignore[attr-defined]
    assert spent is not None and spent >= 0.2
    sb.begin_episode(make_config("usage-pool-2"))  # type: ignore[attr-defined]
    fresh_cpu = sb.resource_usage().cpu_s  # type: ignore[attr-defined]
    assert fresh_cpu is not None and fresh_cpu < spent


@pytest.mark.parametrize(
    "stats",
    [
        None,
        "not a dict",
        {"cpu_stats": {"cpu_usage": {"total_usage": -5}}, "memory_stats": {"max_usage": 1 << 70}},
        {"cpu_stats": {"cpu_usage": {"total_usage": "9" * 40}}, "memory_stats": {"max_usage": True}},
        {"cpu_stats": [], "memory_stats": "x"},
    ],
)
def test_engine_numbers_out_of_bounds_read_as_unknown(stats: object) -> None:
    assert from_docker_stats(stats) == ResourceUsage(None, None)


def test_engine_numbers_in_bounds() -> None:
    u = from_docker_stats({"cpu_stats": {"cpu_usage": {"total_usage": 1_500_000_000}}, "memory_stats": {"max_usage": 3 * MB}})
    assert u == ResourceUsage(1.5, 3 * MB)


def test_docker_reads_the_containers_own_cgroup_files_and_they_agree_with_the_engine(
    fresh: Callable[..., Sandbox], backend: str
) -> None:
    """On this host the docker backend reads the container's cgroup files (the engine's
    stats wait for its next 1 s collection tick: ~2 s of a short episode); both sources
    are the same kernel counters."""
    if backend != "docker":
        pytest.skip("the engine's stats are docker's")
    sb = fresh("usage-cgroup")
    assert sb.exec(WORK, timeout=120).exit_code == 0
    ours = sb.resource_usage()  # type: ignore[attr-defined]
    assert sb._cgroups, "the container's cgroup directories were not found on this host"  # type: ignore[attr-defined]
    engine = from_docker_stats(sb.api.stats(sb.container_id, stream=False, one_shot=True))  # type: ignore[attr-defined]
    assert ours.cpu_s is not None and engine.cpu_s is not None
    assert abs(ours.cpu_s - engine.cpu_s) < 0.2, (ours, engine)  # the helper idles in between
    assert ours.peak_memory_bytes == engine.peak_memory_bytes


def test_a_cgroup_that_does_not_name_the_container_is_not_read() -> None:
    """A reused pid, or a pid of another host's engine: its cgroup is not the container's."""
    assert cgroup_dirs(os.getpid(), "f" * 64) == {}
    assert cgroup_dirs(2**22 + 12345, "f" * 64) == {}  # no such process
    assert cgroup_dirs(os.getpid(), "") == {}
