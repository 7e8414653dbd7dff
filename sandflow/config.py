"""Settings from flags, environment (SANDFLOW_*) and a config file (sandflow.toml).

The application's settings are resolved HERE (a run's) and in sandflow/host.py (this
machine's, which `Settings` includes), then handed to the libraries as values (a RunSpec,
a warehouse root, a JudgeEndpoint, sandbox.settings.configure): no library reads them
(tests/test_settings_boundary.py).

Precedence, highest first: explicit flags (passed as init kwargs), environment,
the config file named by SANDFLOW_CONFIG (default ./sandflow.toml), defaults.
API keys are SecretStr, read from the environment only, and excluded from every
dump, so they never reach disk, logs or trajectories.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import NoDecode

from sandbox.base import DEFAULT_BACKEND
from sandflow.host import HostSettings
from tasks.defaults import DEFAULT_MAX_TOKENS, DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_TEMPERATURE
from tasks.model import API_KEY_ENV
from tasks.pricing import PriceTable, load_prices
from warehouse import DEFAULT_ROOT

if TYPE_CHECKING:
    from datasets_prep.verifiers.judge import JudgeEndpoint
    from tasks.spec import RunSpec

SECRET_FIELDS = frozenset({"api_key", "judge_api_key"})


class Settings(HostSettings):
    """The run's settings (endpoint, sandbox, warehouse, judge) and this machine's (HostSettings)."""

    # Model endpoint (any OpenAI-compatible server). Empty base_url: the embedded model.
    base_url: str | None = None
    model: str | None = None
    api_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices(*API_KEY_ENV), exclude=True
    )
    temperature: float = DEFAULT_TEMPERATURE
    max_tokens: int = DEFAULT_MAX_TOKENS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    # Sandbox
    backend: str = DEFAULT_BACKEND
    image: str | None = None
    network: str = "none"
    # "pool": warm sandboxes reset between episodes; "fresh": one per episode. None: the
    # command's default (runs: fresh; `rl serve`: pool). docs/sandbox.md, "Warm pool".
    sandbox_reuse: Literal["pool", "fresh"] | None = None
    # docker only: the engine's OCI runtime for sandboxes, by its registered name ("runsc":
    # gVisor, opt-in, docs/sandbox.md "gVisor"). None: the engine's default (runc).
    sandbox_runtime: str | None = None

    # Warehouse
    warehouse: Path = Path(DEFAULT_ROOT)
    # What a recorded run survives: a kill -9 loses nothing in every mode; an OS crash
    # loses at most an open episode's last 4 records ("turn"), nothing ("sync": an fsync
    # per turn) or recent records ("flush": nothing waits for the disk). docs/warehouse.md.
    durability: Literal["turn", "sync", "flush"] = "turn"

    # What tokens cost (tasks/pricing.py; docs/cost.md): `[prices."MODEL"]` tables in
    # sandflow.toml, or SANDFLOW_PRICES / --prices as a JSON file or JSON text. None by
    # default: a model without a price costs "unknown", never 0.
    prices: Annotated[PriceTable, NoDecode] = Field(default_factory=lambda: PriceTable({}))

    # Optional LLM judge endpoint
    judge_base_url: str | None = None
    judge_model: str | None = None
    judge_api_key: SecretStr | None = Field(None, exclude=True)

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        """A backend registered in sandbox/backends.py (flag, SANDFLOW_BACKEND, config file)."""
        from sandbox.backends import get_backend

        return get_backend(value.strip()).name

    @field_validator("network")
    @classmethod
    def _network_policy(cls, value: str) -> str:
        """The policy string checked where it is read (flag, SANDFLOW_NETWORK or the config
        file), naming the bad entry (sandbox.netpolicy.parse_network: the one parser)."""
        from sandbox.netpolicy import PolicyError, parse_network

        try:
            parse_network(value)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return value.strip()

    @field_validator("prices", mode="before")
    @classmethod
    def _prices(cls, value: Any) -> Any:
        """A JSON file's path or JSON text (flag, env) or a table (sandflow.toml), checked
        by the one loader (tasks.pricing.load_prices), which names the bad key or field."""
        if value is None or isinstance(value, PriceTable):
            return value or PriceTable({})
        if isinstance(value, str | Path | dict):
            return load_prices(value)
        raise ValueError(f"a price table is a JSON file, JSON text or a table, not {type(value).__name__}")

    def public_dict(self) -> dict[str, Any]:
        """A dump safe to write anywhere: secrets are never included."""
        return self.model_dump(mode="json", exclude=set(SECRET_FIELDS))

    def judge_endpoint(self) -> JudgeEndpoint | None:
        """The LLM judge's endpoint (key included) for `score(..., judge=)`; None unset."""
        if not self.judge_base_url or not self.judge_model:
            return None
        from datasets_prep.verifiers.judge import JudgeEndpoint

        return JudgeEndpoint(
            base_url=self.judge_base_url,
            model=self.judge_model,
            api_key=self.judge_api_key,
            timeout_s=self.request_timeout_s,
        )


def run_spec(s: Settings, **flags: Any) -> RunSpec:
    """A command's RunSpec: what the settings decide (endpoint, sampling, request timeout,
    sandbox backend, image, network, reuse and runtime, recording, prices), then the
    command's own flags (None: not given), through the one builder (tasks.spec.build_run_spec).
    A bad value raises pydantic's ValidationError (a ValueError) naming it."""
    from tasks.spec import build_run_spec

    settled = {
        "model": s.model,
        "base_url": s.base_url,
        "temperature": s.temperature,
        "max_tokens": s.max_tokens,
        "request_timeout_s": s.request_timeout_s,
        "warehouse": str(s.warehouse),
        "backend": s.backend,
        "image": s.image,
        "network": s.network,
        "sandbox_reuse": s.sandbox_reuse,
        "sandbox_runtime": s.sandbox_runtime,
        "durability": s.durability,
        "prices": s.prices.public_dict(),
    }
    return build_run_spec(settled, **flags)


def load_settings(**overrides: Any) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def command_settings(**overrides: Any) -> Settings:
    """load_settings for a command: a bad flag, SANDFLOW_* variable or sandflow.toml entry
    is one sentence naming it, exit code 2 (never a pydantic traceback)."""
    from sandflow.errors import fail

    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(map(str, err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        where = f"--{name.replace('_', '-')}, " if overrides.get(name) is not None else ""
        raise fail(f"invalid setting {name} ({where}SANDFLOW_{name.upper()} or sandflow.toml): {msg}") from None


def flag_prices(flag: str | None) -> PriceTable | None:
    """The --prices flag (a JSON file or JSON text) as a PriceTable; None: not given.
    Raises ValueError with one sentence naming the flag and the file, key or field."""
    if flag is None:
        return None
    try:
        return load_prices(flag)
    except ValueError as exc:
        raise ValueError(f"--prices: {exc}") from None


def settings_warehouse() -> Path:
    """Settings.warehouse for read-only commands: a broken config file must not stop a
    query, so it falls back to SANDFLOW_WAREHOUSE, then DEFAULT_ROOT."""
    try:
        return Path(load_settings().warehouse)
    except (ValidationError, ValueError, OSError):
        return Path(os.environ.get("SANDFLOW_WAREHOUSE", DEFAULT_ROOT))
