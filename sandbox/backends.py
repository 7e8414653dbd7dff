"""The sandbox backends, found by name, and what each can do.

A backend is one module with a class that opens a sandbox for a `SandboxConfig`, and one
`register_backend` call here. Callers outside sandbox/ never compare a backend's name: they
ask its capabilities (`capabilities("bwrap").parallel_open`, `sb.capabilities.fork`).

    from sandbox.backends import backend_names, capabilities, get_backend

    get_backend("docker").open(config)           # what sandbox.open_sandbox does
    capabilities(config.backend).image           # does a preflight check an image?
    backend_names()                              # ("bwrap", "docker"): CLI validation

Inspect AI's `sandboxenv` registry is the model: a name, a factory, and facts about the
backend known before any sandbox is opened.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox.base import Sandbox, SandboxConfig


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, known before a sandbox of it is opened."""

    fork: bool = False
    """`sb.fork(n)`: children with the parent's files and shell state (docs/sandbox.md)."""
    parallel_open: bool = False
    """Sandboxes may be opened from worker threads at once. False for bwrap: its
    --die-with-parent follows the *thread* that started it, so a sandbox opened in a
    short-lived thread would die with that thread."""
    image: bool = False
    """Runs an engine-held image: a run's preflight checks the image and records its id."""
    engine: bool = False
    """Sandboxes run on an addressable engine (`docker_host`); episodes record which one."""
    network_policies: frozenset[str] = frozenset({"none"})
    """The `SandboxLimits.network` policies the backend enforces."""
    usage: bool = False
    """`sb.resource_usage()` reads real cgroup counters (CPU, peak memory)."""
    snapshot_volumes: bool = False
    """Writable places can live on copy-on-write volumes (a fork becomes a snapshot)."""


@dataclass(frozen=True)
class Backend:
    """A registered backend: its name, where its sandbox class lives, its capabilities."""

    name: str
    target: str  # "module:Class", imported on first use (docker's SDK stays unloaded for bwrap)
    capabilities: Capabilities

    def open(self, config: SandboxConfig) -> Sandbox:
        """Start a sandbox of this backend (ready when this returns)."""
        module, _, cls = self.target.partition(":")
        factory: Any = getattr(importlib.import_module(module), cls)
        sandbox: Sandbox = factory(config)
        return sandbox


_LOCK = threading.Lock()
_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, target: str, capabilities: Capabilities) -> Backend:
    """Make backend `name` available to `SandboxConfig(backend=name)` and every caller."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"a backend name is letters, digits, '-' and '_': {name!r}")
    if ":" not in target:
        raise ValueError(f"backend {name!r}: target must be 'module:Class', not {target!r}")
    entry = Backend(name, target, capabilities)
    with _LOCK:
        _BACKENDS[name] = entry
    return entry


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, sorted."""
    with _LOCK:
        return tuple(sorted(_BACKENDS))


def get_backend(name: str) -> Backend:
    """The registered backend `name`; ValueError naming the known ones otherwise."""
    with _LOCK:
        found = _BACKENDS.get(name)
    if found is None:
        known = " or ".join(repr(n) for n in backend_names())
        raise ValueError(f"unknown sandbox backend {name!r}: use {known}")
    return found


def capabilities(name: str) -> Capabilities:
    """What backend `name` can do (ValueError for an unknown name)."""
    return get_backend(name).capabilities


_POLICIES = frozenset({"none", "bridge", "host", "allowlist", "open"})

register_backend(
    "docker",
    "sandbox.docker_backend:DockerSandbox",
    Capabilities(
        fork=True, parallel_open=True, image=True, engine=True,
        network_policies=_POLICIES, usage=True,
    ),
)
register_backend(
    "bwrap",
    "sandbox.bwrap_backend:BwrapSandbox",
    Capabilities(
        fork=True, parallel_open=False, image=False, engine=False,
        network_policies=_POLICIES, usage=True, snapshot_volumes=True,
    ),
)
