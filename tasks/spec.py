"""RunSpec: ONE description of a run, built once by the command, carried by every flow and episode.

A run is a task set x a model x a mode x samples, recorded in a warehouse, within limits.
The command (`sandflow run`, `sandflow bench`, `sandflow flows run`, a deployment) resolves
flags, SANDFLOW_* settings and defaults into one RunSpec; the run flow, each episode task
(also in a Dask worker) and the agent loop read it. The configs the loop takes are derived
here and only here: `to_model_config()`, `to_limits()`, `to_sandbox_config()`.

Adding a run parameter: a field here, and the line that uses it (plus a CLI flag or a
deployment parameter if users should set it).

It lives in tasks/ because that is the lowest layer that uses every part of it (model,
limits, sandbox, prompts); flows/ and rl/ carry it. It never holds a secret: it is a
Prefect parameter, and Prefect stores parameters. The API key is looked up by
`to_model_config()` in the process that calls the model (tasks.model.api_key_from_env).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandbox import settings as host_settings
from sandbox.base import SandboxConfig, SandboxLimits
from sandbox.netpolicy import PolicyError, parse_network
from tasks.defaults import DEFAULT_MAX_STEPS, DEFAULT_WALL_CLOCK_S
from tasks.loop import Limits
from tasks.model import DEFAULT_RETRY_WINDOW_S, ModelConfig, api_key_from_env

# request_timeout_s when none is given. The embedded server stops a generation when its
# client leaves and bounds each call's tokens (tasks/local_model_app.py): a timed-out call
# frees it at once, so its retry no longer queues behind abandoned work and needs no longer wait.
DEFAULT_REQUEST_TIMEOUT_S = 120.0


class RunSpec(BaseModel):
    """What a run is. Every field is a plain value (JSON-safe: Prefect stores it)."""

    model_config = ConfigDict(extra="forbid")

    # what to run
    task_set: str = Field("smoke", description="task-set file, built-in suite, hf:NAME or table")
    mode: str = Field("both", description="sandbox | llm | both")
    samples: int = Field(1, description="samples per task and mode")
    run_id: str | None = Field(None, description="resume this run; None: a new id")
    # the model (any OpenAI-compatible endpoint; no base_url: the embedded model)
    model: str | None = None
    base_url: str | None = None
    temperature: float = 0.7
    max_tokens: int = 2048
    request_timeout_s: float | None = Field(None, description="None: 120 s")
    model_retry_window_s: float | None = Field(
        None, ge=0, description="how long one model call's retries go on; None: 150 s"
    )
    extra_body: dict[str, Any] = Field(default_factory=dict)
    logprobs: bool = False
    return_token_ids: bool = False
    # each episode's limits
    max_steps: int = DEFAULT_MAX_STEPS
    wall_clock_s: float = DEFAULT_WALL_CLOCK_S
    exec_timeout_s: float | None = None
    context_tokens: int | None = None
    max_tool_calls_per_turn: int | None = Field(None, description="None: the loop's default (Limits)")
    max_observation_bytes_per_turn: int | None = Field(None, description="None: the loop's default (Limits)")
    prompt_dir: str | None = None
    # the sandbox
    backend: str = "docker"
    image: str | None = None
    network: str = "none"
    sandbox_reuse: str = Field("fresh", description="fresh sandbox per episode, or 'pool' (reset and reused)")
    sandbox_runtime: str | None = Field(None, description="docker: the engine's OCI runtime ('runsc': gVisor); None: runc")
    sandbox_host: dict[str, Any] = Field(
        default_factory=lambda: host_settings.current().changed(),
        description="the sandbox settings that differ from the defaults in the process that "
        "built the spec (sandbox.settings.HostSettings, handed in by the application: engine "
        "call bound, netns reuse, ...), carried to every process that runs its episodes "
        "(Dask workers included)",
    )
    # the run: where it is recorded, how wide it fans out, how it recovers
    warehouse: str | None = Field(None, description="None: episodes are not recorded there")
    concurrency: int = 4
    max_sandboxes: int | None = Field(None, description="live sandboxes; None: concurrency")
    max_model_calls: int | None = Field(None, description="concurrent model calls; None: no bound")
    retries: int = Field(2, description="retries of an episode after an infrastructure failure")
    durability: Literal["turn", "sync", "flush"] = Field(
        "turn",
        description="what survives an OS crash (a kill -9 loses nothing recorded in every mode): "
        "'turn' loses at most the last 4 records of an open episode (fsynced in the background "
        "within milliseconds), 'sync' nothing (fsync in every record_turn), 'flush' recent "
        "records (nothing waits for the disk); docs/warehouse.md",
    )
    compact: bool = Field(True, description="merge the run's files at its end")
    wait_for_lock: bool | float = Field(
        False, description="another process runs this run id: wait (True, or seconds) instead of refusing"
    )
    prices: dict[str, Any] = Field(
        default_factory=dict,
        description="price table (tasks.pricing.PriceTable as JSON) the run records for its cost",
    )
    series: str | None = Field(
        None, description="the series this run continues (its report compares with the previous run)"
    )

    @field_validator("network")
    @classmethod
    def _network_policy(cls, value: str) -> str:
        """A bad policy string fails when the spec is built, naming the bad entry."""
        try:
            parse_network(value)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return value.strip()

    def to_model_config(self, *, with_key: bool = True) -> ModelConfig:
        """The agent loop's ModelConfig; the API key from this process's environment."""
        return ModelConfig(
            model=self.model or "default",
            base_url=self.base_url,
            api_key=api_key_from_env() if with_key else None,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            request_timeout_s=self.request_timeout_s or DEFAULT_REQUEST_TIMEOUT_S,
            retry_window_s=(
                DEFAULT_RETRY_WINDOW_S if self.model_retry_window_s is None else self.model_retry_window_s
            ),
            extra_body=dict(self.extra_body),
            logprobs=self.logprobs,
            return_token_ids=self.return_token_ids,
        )

    def to_limits(self) -> Limits:
        per_turn = {
            name: value
            for name in ("max_tool_calls_per_turn", "max_observation_bytes_per_turn")
            if (value := getattr(self, name)) is not None
        }
        return Limits(
            max_steps=self.max_steps,
            wall_clock_s=self.wall_clock_s,
            exec_timeout_s=self.exec_timeout_s,
            context_tokens=self.context_tokens,
            **per_turn,
        )

    def to_sandbox_config(self, run_id: str | None = None) -> SandboxConfig:
        return SandboxConfig(
            backend=self.backend,
            image=self.image,
            run_id=run_id or self.run_id or "adhoc",
            limits=SandboxLimits(network=self.network),
            reuse=self.sandbox_reuse,  # pydantic checks "pool" / "fresh"
            runtime=self.sandbox_runtime,
        )

    def public_dict(self) -> dict[str, Any]:
        """What the warehouse records about the run (no secret is ever in a RunSpec)."""
        return self.model_dump(mode="json")
