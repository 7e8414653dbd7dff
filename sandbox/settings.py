"""The sandbox library's host-wide settings: handed in, never read from the environment.

No module of sandbox/ reads a SANDFLOW_* variable (sandbox/_helper.py, which runs
inside the sandbox, reads the values the backends hand it). The application resolves
these (sandflow/config.py: environment, config file) and calls `configure(...)` once
when it starts; a run hands them on to its worker processes (RunSpec.sandbox_host), and
a library user (a trainer embedding rl.SandboxEnv, a test) calls `configure` the same
way or keeps the defaults. Code reads `current()` at use time, so a change applies to
the next sandbox, engine call or proxy start.

Stdlib only: sandbox/image.py imports it when scripts/setup.sh runs it with the system
Python, before the project's environment exists.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DEFAULT_EGRESS_DIR = Path("/var/tmp/sandflow-egress")


@dataclass(frozen=True)
class HostSettings:
    """Knobs of the host, not of one sandbox (those are SandboxConfig / SandboxLimits)."""

    engine_call_timeout_s: float = 60.0
    """The bound on each Docker engine call (a hung engine is a sandbox_error, retried)."""
    engine_calls_in_flight: int = 16
    """Engine calls (create, start, remove...) sent at once; the rest wait their turn
    (sandbox/deadline.py says why: 256 at once made each take up to a minute)."""
    netns_reuse: bool = True
    """Network-less sandboxes join a pooled, empty network namespace (docs/sandbox.md)."""
    privsep: bool = True
    """The in-sandbox helper runs as uid 0 apart from the sandbox user (False: for engines
    that refuse a root user; then only its non-dumpable mark guards its channel)."""
    egress_dir: Path | None = None
    """The egress proxies' state (squid configs, logs, cache). None: /var/tmp/sandflow-egress
    for root; a non-root bwrap user gets `<that>-<uid>`."""
    egress_cache_mb: int = 8192
    """Disk for the egress proxy's shared download cache, per policy (0: no cache)."""
    egress_nflog_group: int = 31413
    """The netfilter log group of the docker egress firewall's refusal log."""
    cache_dir: Path | None = None
    """The image build's cache (the bwrap backend's root filesystems). None:
    $XDG_CACHE_HOME/sandflow (~/.cache/sandflow)."""
    debian_mirror: str | None = None
    """The image build's Debian mirror. None: the one this machine's apt uses."""
    bwrap_volumes: Path | None = None
    """A btrfs mount (root only; `scripts/setup.sh --volumes` makes one) where bwrap
    sandboxes keep their workdir, home and /tmp as subvolumes instead of tmpfs: a fork is
    a snapshot (sandbox/volumes.py; docs/sandbox.md, "Copy-on-write"). None: tmpfs."""

    def __post_init__(self) -> None:
        if not self.engine_call_timeout_s > 0:
            raise ValueError(f"engine_call_timeout_s={self.engine_call_timeout_s!r} must be > 0 seconds")
        if self.engine_calls_in_flight < 1:
            raise ValueError(f"engine_calls_in_flight={self.engine_calls_in_flight!r} must be >= 1")
        if self.egress_cache_mb < 0:
            raise ValueError(f"egress_cache_mb={self.egress_cache_mb!r} must be >= 0 (0: no cache)")
        if not 0 <= self.egress_nflog_group <= 65535:
            raise ValueError(f"egress_nflog_group={self.egress_nflog_group!r} must be within 0..65535")

    def changed(self) -> dict[str, Any]:
        """The values that differ from the defaults, JSON-safe (what a run hands on)."""
        default = HostSettings()
        return {
            f.name: str(v) if isinstance(v, Path) else v
            for f in fields(self)
            if (v := getattr(self, f.name)) != getattr(default, f.name)
        }


_lock = threading.Lock()
_current = HostSettings()


def current() -> HostSettings:
    return _current


def configure(settings: HostSettings | None = None, **changes: Any) -> HostSettings:
    """Use `settings` (or the current ones with `changes`) from now on; returns the
    previous settings, so a caller can put them back."""
    global _current
    for name in ("egress_dir", "cache_dir", "bwrap_volumes"):
        if isinstance(changes.get(name), str):
            changes[name] = Path(changes[name])
    with _lock:
        previous = _current
        _current = dataclasses.replace(settings or previous, **changes)
        return previous
