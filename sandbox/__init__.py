"""sandflow's virtual computer: one interface, two backends (docker, bubblewrap).

    from sandbox import SandboxConfig, open_sandbox

    with open_sandbox(SandboxConfig(run_id="r1", episode_id="e1")) as sb:
        sb.exec("cd /testbed && export X=1")
        print(sb.exec("echo $X; pwd").stdout)      # cwd and exports carry over
        sb.write_file("input/data.bin", b"\\x00\\x01")
        sb.copy_out("/testbed/output", "host/out")   # never writes outside host/out

See docs/sandbox.md for limits and the security model.
"""

from __future__ import annotations

from sandbox.base import (
    BackendName,
    ExecResult,
    NetworkPolicy,
    Sandbox,
    SandboxClosed,
    SandboxConfig,
    SandboxError,
    SandboxExpired,
    SandboxLimits,
)

__all__ = [
    "BackendName",
    "ExecResult",
    "NetworkPolicy",
    "Sandbox",
    "SandboxClosed",
    "SandboxConfig",
    "SandboxError",
    "SandboxExpired",
    "SandboxLimits",
    "acquire",
    "open_sandbox",
    "prewarm",
]


def open_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """Start a sandbox for `config` (default: docker, the shared image, safe limits).

    The sandbox is ready when this returns (its shell answered). Always close it (or use
    it as a context manager); live sandboxes are also removed at interpreter exit and on
    SIGINT/SIGTERM. Raises SandboxError when the engine, image or rootfs is missing.
    """
    from sandbox.backends import get_backend

    config = config or SandboxConfig()
    return get_backend(config.backend).open(config)


POOLED_NETWORKS = ("none", "bridge")


def acquire(config: SandboxConfig | None = None) -> Sandbox:
    """A sandbox for one episode: from the warm pool (`config.reuse == "pool"`) or fresh.

    A pooled sandbox's close() gives it back: it is reset in the background (every process
    killed, every writable place wiped, a new shell) and serves the next episode, or it is
    destroyed when the reset cannot prove a fresh state (sandbox/pool.py). Only network
    policies "none" and "bridge" are pooled: under "host" a reset cannot see the host's
    sockets, and "allowlist"/"open" set up an egress proxy per sandbox.
    """
    config = config or SandboxConfig()
    if config.reuse == "fresh" or config.limits.network not in POOLED_NETWORKS:
        return open_sandbox(config)
    from sandbox.pool import pool_for

    return pool_for(config).acquire(config)


def prewarm(config: SandboxConfig, n: int) -> int:
    """Start `n` sandboxes of `config`'s kind in the background, ready for `acquire`.

    Why: a run knows how many episodes it will hold at once before the first one asks;
    creating their sandboxes while it sets up (and all at once, paced) takes the engine's
    start time off the first episodes. A no-op (0) for fresh-per-episode sandboxes and
    for unpooled networks; returns how many are idle now (the rest start in the background).
    """
    if n < 1 or config.reuse == "fresh" or config.limits.network not in POOLED_NETWORKS:
        return 0
    from sandbox.pool import pool_for

    return pool_for(config).prewarm(n, wait=False)
