"""The sandbox contract: what an episode may ask of its virtual computer.

Modelled on Inspect AI's sandbox interface (exec / read_file / write_file with typed
results and explicit limits). Every backend (docker, bubblewrap) implements `Sandbox`
and passes the same test suite. Errors are typed so callers can tell the model's own
doing (a command that failed, timed out, ran out of memory: an `ExecResult`) from
broken infrastructure (`SandboxError`: retry the episode elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, field_validator, model_validator

if TYPE_CHECKING:
    from sandbox.archive import ExportedFiles  # a list[Path] with .skipped and .summary
    from sandbox.backends import Capabilities
    from sandbox.usage import ResourceUsage

NetworkPolicy = Literal["none", "bridge", "host", "allowlist", "open"]
BackendName = str  # a name registered in sandbox/backends.py ("docker", "bwrap", ...)
# THE default backend (a run's sandbox part, the settings, a SandboxConfig)
DEFAULT_BACKEND: BackendName = "docker"


class ExecResult(BaseModel):
    """One command's outcome. A failing command is a result, never an exception."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    dropped_bytes: int = 0
    shell_restarted: bool = Field(
        False, description="the session shell died or was stuck and a fresh one was started"
    )

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


class SandboxLimits(BaseModel):
    """Resource bounds for one sandbox; defaults are safe for a shared 2-core host."""

    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, ge=64)
    pids: int = Field(512, ge=16)
    wall_clock_s: float | None = Field(None, gt=0, description="hard lifetime of the sandbox")
    exec_timeout_s: float = Field(120.0, gt=0, description="default per-command timeout")
    output_cap_bytes: int = Field(32_000, ge=256, description="per stream; head and tail kept")
    network: NetworkPolicy = "none"
    egress_allow: tuple[str, ...] = Field(
        (),
        description="network 'allowlist': DEST[:PORTS] entries the egress proxy may reach "
        "(sandbox/netpolicy.py: names, *.domains, IPs/CIDRs)",
    )
    egress_hosts: tuple[str, ...] = Field(
        (), description="NAME=ADDRESS lines for the egress proxy's resolver (local listeners)"
    )
    tmp_size_mb: int = Field(1024, ge=16, description="size bound of writable scratch space")
    shm_size_mb: int = Field(
        64, ge=1, description="size bound of /dev/shm (POSIX shared memory and semaphores)"
    )

    @model_validator(mode="before")
    @classmethod
    def _network_spec(cls, data: Any) -> Any:
        """`network="allowlist:pypi.org *.pythonhosted.org:443"` (one string, as a flag, an
        env var or a task's metadata carry it): the mode and its entries, split on spaces
        or ';'."""
        if isinstance(data, dict) and isinstance(data.get("network"), str):
            mode, sep, entries = data["network"].partition(":")
            if sep:
                allow = tuple(e for e in entries.replace(";", " ").split() if e)
                data = {**data, "network": mode.strip(), "egress_allow": allow}
        return data

    @model_validator(mode="after")
    def _check_egress(self) -> SandboxLimits:
        """An allowlist that cannot be understood fails here, naming the entry."""
        if self.network in ("allowlist", "open"):
            from sandbox.netpolicy import EgressPolicy, PolicyError, parse_hosts

            try:
                EgressPolicy.build(self.network, self.egress_allow)
                parse_hosts(self.egress_hosts)
            except PolicyError as e:
                raise ValueError(str(e)) from None
        elif self.egress_allow:
            raise ValueError(
                f"egress_allow is set but network is {self.network!r} (use 'allowlist')"
            )
        return self


class SandboxConfig(BaseModel):
    """Everything needed to open one sandbox."""

    backend: BackendName = DEFAULT_BACKEND
    image: str | None = None  # default: the content-hashed tag of sandbox.image.DEFAULT_SPEC
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    run_id: str = "adhoc"
    episode_id: str = "adhoc"
    ttl_s: int = Field(6 * 3600, gt=0, description="gc removes the sandbox after this")
    workdir: str = "/testbed"
    env: dict[str, str] = Field(default_factory=dict)
    docker_host: str | None = None  # e.g. ssh://user@gpu-box or tcp://host:2376
    runtime: str | None = Field(
        None,
        description="docker only: the OCI runtime the engine runs the sandbox with, by its "
        "registered name (e.g. 'runsc' for gVisor: docs/sandbox.md, 'gVisor'); None: the "
        "engine's default (runc)",
    )
    reuse: Literal["pool", "fresh"] = Field(
        "fresh",
        description="sandbox.acquire() (the episode runner): 'pool' hands out a reset sandbox "
        "from this process's warm pool, 'fresh' opens one per episode (docs/sandbox.md, 'Warm pool')",
    )
    max_episodes_per_sandbox: int = Field(
        100, ge=1, description="a pooled sandbox is replaced after this"
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        from sandbox.backends import get_backend

        get_backend(name)  # ValueError naming the registered ones
        return name


class SandboxError(RuntimeError):
    """The infrastructure failed (engine gone, container died): retry, don't grade."""


class SandboxClosed(SandboxError):
    """The sandbox was used after close()."""


class SandboxExpired(SandboxClosed):
    """The sandbox's wall-clock lifetime (limits.wall_clock_s) ran out; it was removed.

    This is the episode's own time limit, not broken infrastructure: end the episode.
    """


@runtime_checkable
class Sandbox(Protocol):
    """A running virtual computer with a persistent shell session."""

    config: SandboxConfig
    backend: str

    @property
    def capabilities(self) -> Capabilities: ...

    def exec(self, command: str, timeout: float | None = None) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes | str) -> None: ...

    def copy_in(self, host_dir: Path | str, dest: str) -> None: ...

    def copy_out(self, src: str, host_dir: Path | str) -> ExportedFiles: ...

    def fork(self, n: int = 1, *, children: list[Any] | None = None) -> list[Any]:
        """n children with this sandbox's files and shell state (`capabilities.fork`)."""
        ...

    def resource_usage(self) -> ResourceUsage:
        """CPU and peak memory since the episode began (real when `capabilities.usage`)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Sandbox: ...

    def __exit__(self, *exc: object) -> None: ...
