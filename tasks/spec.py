"""RunSpec: ONE description of a run, made of parts, built by ONE function, carried by
every flow and episode.

A run is a task set x a model x a mode x samples, recorded in a warehouse, within limits.
Its description has parts, each with its defaults here and only here:

    endpoint  Endpoint       the model and where it is served, how long a call waits
    sampling  Sampling       how the model samples (temperature, max_tokens, logprobs...)
    limits    EpisodeLimits  each episode's turns, wall clock, commands, context
    sandbox   SandboxSpec    backend, image, network policy, reuse, runtime
    recording Recording      the warehouse, durability, compaction, lock, series
    fanout    FanOut         concurrency, live sandboxes, model calls, retries
    budget    Budget         prices and the run's budget in USD and tokens

`build_run_spec(values, **flags)` is the one builder (tests/test_architecture.py checks
that nothing else constructs one): the command hands it its settings' values
(sandflow/config.py: `run_spec`), then its flags; a flow or a deployment its parameters.
It takes the flat names (`temperature=`, `backend=`, `sandbox_reuse=`: FLAT_NAMES) or
whole parts (`sampling=Sampling(...)`); None means "not given": the part's default.
A stored spec of the old flat form (one model of 45 fields: run records, Prefect
parameters of past flow runs) still loads: its keys are moved into the parts.

The configs the loop takes are derived here and only here: `to_model_config()`,
`to_limits()`, `to_sandbox_config()`. Adding a run parameter: a field in its part, and
the line that uses it (plus a CLI flag or a deployment parameter if users should set it).

It lives in tasks/ because that is the lowest layer that uses every part of it (model,
limits, sandbox, prompts); flows/ and rl/ carry it. It never holds a secret: it is a
Prefect parameter, and Prefect stores parameters. The API key is looked up by
`to_model_config()` in the process that calls the model (tasks.model.api_key_from_env).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sandbox import settings as host_settings
from sandbox.base import DEFAULT_BACKEND, SandboxConfig, SandboxLimits
from sandbox.netpolicy import PolicyError, parse_network
from tasks.defaults import (
    DEFAULT_MAX_STEPS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_TEMPERATURE,
    DEFAULT_WALL_CLOCK_S,
)
from tasks.loop import Limits
from tasks.model import DEFAULT_RETRY_WINDOW_S, ModelConfig, api_key_from_env

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT_S", "FLAT_NAMES", "Budget", "Endpoint", "EpisodeLimits", "FanOut",
    "Recording", "RunSpec", "SandboxSpec", "Sampling", "build_run_spec", "model_config_of",
]  # fmt: skip


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Endpoint(_Part):
    """The model: any OpenAI-compatible endpoint (no base_url: the embedded model)."""

    base_url: str | None = Field(None, description="None: the embedded model, started for the run")
    model: str | None = Field(None, description="the model's name as its server serves it; None: its only one")
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0, description="seconds one call waits")
    max_retries: int | None = Field(None, ge=0, description="None: retries bounded by retry_window_s only")
    retry_window_s: float = Field(
        DEFAULT_RETRY_WINDOW_S, ge=0, description="how long one model call's retries go on"
    )


class Sampling(_Part):
    """How the model samples; the names are tasks.model.ModelConfig's."""

    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="completion tokens per call")
    logprobs: bool = Field(False, description="ask for completion logprobs")
    return_token_ids: bool = Field(False, description="ask a vLLM server for exact token ids")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="passed as is (top_k, min_p...)")


class EpisodeLimits(_Part):
    """Each episode's limits (tasks.loop.Limits; None: the loop's own default)."""

    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1)
    wall_clock_s: float = Field(DEFAULT_WALL_CLOCK_S, gt=0)
    exec_timeout_s: float | None = None
    context_tokens: int | None = None
    max_tool_calls_per_turn: int | None = Field(None, description="None: the loop's default (Limits)")
    max_observation_bytes_per_turn: int | None = Field(None, description="None: the loop's default (Limits)")


class SandboxSpec(_Part):
    """Where sandbox-mode episodes run."""

    backend: str = DEFAULT_BACKEND
    image: str | None = None
    network: str = "none"
    reuse: str = Field("fresh", description="fresh sandbox per episode, or 'pool' (reset and reused)")
    runtime: str | None = Field(None, description="docker: the engine's OCI runtime ('runsc': gVisor); None: runc")
    host: dict[str, Any] = Field(
        default_factory=lambda: host_settings.current().changed(),
        description="the sandbox settings that differ from the defaults in the process that "
        "built the spec (sandbox.settings.HostSettings, handed in by the application: engine "
        "call bound, netns reuse, ...), carried to every process that runs its episodes "
        "(Dask workers included)",
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


class Recording(_Part):
    """Where the run is recorded and what survives a crash."""

    warehouse: str | None = Field(None, description="None: episodes are not recorded there")
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
    series: str | None = Field(
        None, description="the series this run continues (its report compares with the previous run)"
    )


class FanOut(_Part):
    """How wide the run fans out and how it recovers."""

    concurrency: int = Field(4, description="episodes at once")
    max_sandboxes: int | None = Field(None, description="live sandboxes; None: concurrency")
    max_model_calls: int | None = Field(None, description="concurrent model calls; None: no bound")
    retries: int = Field(2, description="retries of an episode after an infrastructure failure")


class Budget(_Part):
    """What the run may spend (engine.budget)."""

    prices: dict[str, Any] = Field(
        default_factory=dict,
        description="price table (tasks.pricing.PriceTable as JSON) the run records for its cost",
    )
    max_cost_usd: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="the run's budget in USD, priced by `prices` (engine.budget): once the "
        "warehouse's turns of the run plus the running ones cost this much, no episode starts "
        "and running ones end `budget_exhausted`; None: no budget",
    )
    max_run_tokens: int | None = Field(
        None, ge=1, description="the run's budget in tokens (prompt + completion, all its turns); None: none"
    )


PARTS: dict[str, type[_Part]] = {
    "endpoint": Endpoint, "sampling": Sampling, "limits": EpisodeLimits, "sandbox": SandboxSpec,
    "recording": Recording, "fanout": FanOut, "budget": Budget,
}  # fmt: skip
# The flat names (the old flat RunSpec's fields, the settings' and flags' names) -> (part,
# field). A part's field not renamed here keeps its name.
_RENAMED = {
    "model_retry_window_s": ("endpoint", "retry_window_s"),
    "sandbox_reuse": ("sandbox", "reuse"),
    "sandbox_runtime": ("sandbox", "runtime"),
    "sandbox_host": ("sandbox", "host"),
}
FLAT_NAMES: dict[str, tuple[str, str]] = {
    **{
        name: (part, name)
        for part, cls in PARTS.items()
        for name in cls.model_fields
        if (part, name) not in _RENAMED.values()
    },
    **_RENAMED,
}
# old flat fields that were optional ("None: 120 s"): None there is the part's default
_NONE_IS_DEFAULT = frozenset({"request_timeout_s", "model_retry_window_s"})


def _into_parts(data: Mapping[str, Any]) -> dict[str, Any]:
    """Flat names moved into their parts (over a part given whole)."""
    out: dict[str, Any] = {}
    flat: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        where = FLAT_NAMES.get(key)
        if where is None:
            out[key] = value.model_dump() if isinstance(value, _Part) else value
        elif not (value is None and key in _NONE_IS_DEFAULT):
            flat.setdefault(where[0], {})[where[1]] = value
    for part, fields in flat.items():
        given = out.get(part)
        out[part] = {**(given if isinstance(given, Mapping) else {}), **fields}
    return out


class RunSpec(_Part):
    """What a run is. Every field is a plain value (JSON-safe: Prefect stores it)."""

    # what to run
    task_set: str = Field("smoke", description="task-set file, built-in suite, hf:NAME or table")
    mode: str = Field("both", description="sandbox | llm | both")
    samples: int = Field(1, description="samples per task and mode")
    run_id: str | None = Field(None, description="resume this run; None: a new id")
    prompt_dir: str | None = Field(None, description="the agent's prompts; None: the built-in ones")
    # the parts
    endpoint: Endpoint = Field(default_factory=Endpoint)
    sampling: Sampling = Field(default_factory=Sampling)
    limits: EpisodeLimits = Field(default_factory=EpisodeLimits)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    recording: Recording = Field(default_factory=Recording)
    fanout: FanOut = Field(default_factory=FanOut)
    budget: Budget = Field(default_factory=Budget)

    @model_validator(mode="before")
    @classmethod
    def _flat_to_parts(cls, data: Any) -> Any:
        """A spec of the old flat form (stored run records, Prefect parameters) loads."""
        return _into_parts(data) if isinstance(data, Mapping) else data

    def replace(self, **changes: Any) -> RunSpec:
        """This spec with `changes` (flat names or parts; None is a value here), checked."""
        return RunSpec.model_validate({**self.model_dump(), **changes})

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> RunSpec:
        """pydantic's copy, refusing a name that is not a field (a flat name would be set
        beside its part and read by nobody): `replace()` takes flat names."""
        unknown = sorted(set(update or ()) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"RunSpec.model_copy: {', '.join(unknown)} not a field of the spec; use .replace()")
        return super().model_copy(update=update, deep=deep)

    def to_model_config(self, *, with_key: bool = True) -> ModelConfig:
        """The agent loop's ModelConfig; the API key from this process's environment."""
        return model_config_of(self.endpoint, self.sampling, api_key_from_env() if with_key else None)

    def to_limits(self) -> Limits:
        return Limits(**self.limits.model_dump(exclude_none=True))  # None: the loop's default

    def to_sandbox_config(self, run_id: str | None = None) -> SandboxConfig:
        return SandboxConfig(
            backend=self.sandbox.backend,
            image=self.sandbox.image,
            run_id=run_id or self.run_id or "adhoc",
            limits=SandboxLimits(network=self.sandbox.network),
            reuse=self.sandbox.reuse,  # pydantic checks "pool" / "fresh"
            runtime=self.sandbox.runtime,
        )

    def public_dict(self) -> dict[str, Any]:
        """What the warehouse records about the run (no secret is ever in a RunSpec)."""
        return self.model_dump(mode="json")


def model_config_of(endpoint: Endpoint, sampling: Sampling, api_key: Any = None) -> ModelConfig:
    """The ModelConfig of an endpoint and a sampling (a run's, a rollout request's)."""
    return ModelConfig(
        **endpoint.model_dump(exclude={"model", "api_key"}),
        model=endpoint.model or "default",
        api_key=api_key,
        **sampling.model_dump(),
    )


def build_run_spec(values: Mapping[str, Any] | None = None, /, **flags: Any) -> RunSpec:
    """THE builder of a RunSpec: `values` (the settings' as the application hands them in,
    or a flow's parameters), then `flags` over them. Flat names or parts; None is "not
    given" (the part's default). A bad value raises pydantic's ValidationError naming it."""
    given = {k: v for part in (values or {}, flags) for k, v in part.items() if v is not None}
    return RunSpec.model_validate(given)
