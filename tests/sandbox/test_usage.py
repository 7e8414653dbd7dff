"""CPU-seconds and peak memory from the sandbox's cgroup (issue #28), on both backends:
the kernel's counts, which nothing inside the sandbox can change."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sandbox import Sandbox
from sandbox.usage import ResourceUsage, from_docker_stats

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
