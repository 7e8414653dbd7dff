"""This machine's settings, handed to the libraries when the application starts.

The libraries never read SANDFLOW_* (tests/test_settings_boundary.py fails if one does):
the CLI resolves these once (`apply_host_settings`, in the root command) from the
environment (`SANDFLOW_<NAME>`) and the config file (`<name> = ...` in sandflow.toml or
the file named by SANDFLOW_CONFIG), and configures each library with plain values. A run
hands the sandbox's share on to its worker processes (RunSpec.sandbox.host).

Kept apart from sandflow/config.py (the run's settings) so that `sandflow --help` does
not pay for importing the libraries: only settings that differ from the defaults are
handed down, and only then is the library imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

SANDBOX_FIELDS = {  # ours -> sandbox.settings.HostSettings
    "engine_call_timeout_s": "engine_call_timeout_s",
    "engine_calls_in_flight": "engine_calls_in_flight",
    "netns_reuse": "netns_reuse",
    "sandbox_privsep": "privsep",
    "egress_dir": "egress_dir",
    "egress_cache_mb": "egress_cache_mb",
    "egress_nflog_group": "egress_nflog_group",
    "cache_dir": "cache_dir",
    "debian_mirror": "debian_mirror",
    "bwrap_volumes": "bwrap_volumes",
}
DATA_FIELDS = ("python_docs", "nltk_data")
LIMIT_FIELDS = ("max_file_bytes", "max_text_bytes", "max_task_bytes", "max_files_per_task", "max_table_bytes")


class HostSettings(BaseSettings):
    """The settings of this machine that the libraries are handed when the application
    starts (`apply_host_settings`): engine and sandbox knobs, caches, offline data, the
    bounds on task data. Each is `SANDFLOW_<NAME>` or `<name> = ...` in the config file."""

    model_config = SettingsConfigDict(env_prefix="SANDFLOW_", extra="ignore")

    # sandbox/ (sandbox.settings.HostSettings)
    engine_call_timeout_s: float = Field(60.0, gt=0, description="bound on each Docker engine call")
    engine_calls_in_flight: int = Field(16, ge=1, description="Docker engine calls sent at once")
    netns_reuse: bool = Field(True, description="network-less sandboxes share pooled network namespaces")
    sandbox_privsep: bool = Field(True, description="the in-sandbox helper runs as uid 0, apart from the user")
    egress_dir: Path | None = Field(None, description="egress proxies' state; None: /var/tmp/sandflow-egress")
    egress_cache_mb: int = Field(8192, ge=0, description="egress download cache per policy, MB (0: none)")
    egress_nflog_group: int = Field(31413, ge=0, le=65535, description="docker egress firewall's log group")
    cache_dir: Path | None = Field(None, description="image build cache; None: ~/.cache/sandflow")
    debian_mirror: str | None = Field(None, description="image build mirror; None: this machine's apt's")
    bwrap_volumes: Path | None = Field(None, description="btrfs mount for bwrap places: forks are snapshots")
    # datasets_prep/ (datasets_prep.settings, datasets_prep.limits)
    python_docs: Path = Field(Path("/usr/share/doc/python3.11/html/_sources"), description="long_context's docs")
    nltk_data: Path | None = Field(None, description="NLTK data for IFBench; None: ~/.cache/sandflow/nltk_data")
    max_file_bytes: int = Field(64 << 20, ge=1, description="one input file of a task")
    max_text_bytes: int = Field(4 << 20, ge=1, description="one text field of a task")
    max_task_bytes: int = Field(256 << 20, ge=1, description="a whole task")
    max_files_per_task: int = Field(10_000, ge=1, description="input files of one task")
    max_table_bytes: int = Field(1024 << 20, ge=1, description="one table file read by the loaders")
    # tasks/ (tasks.local_model)
    local_gguf: Path | None = Field(None, description="the embedded model's .gguf; None: SmolLM2-135M")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = Path(os.environ.get("SANDFLOW_CONFIG", "sandflow.toml"))
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path.is_file():
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    def changed(self, names: Any) -> dict[str, Any]:
        """Those of `names` set to something other than their default."""
        fields = type(self).model_fields
        return {n: getattr(self, n) for n in names if getattr(self, n) != fields[n].default}

    def sandbox_host(self) -> dict[str, Any]:
        """The sandbox library's share that differs from its defaults, JSON-safe (what
        `sandbox.settings.configure` takes, and what a RunSpec carries to workers)."""
        return {
            SANDBOX_FIELDS[k]: str(v) if isinstance(v, Path) else v
            for k, v in self.changed(SANDBOX_FIELDS).items()
        }


def apply_host_settings(host: HostSettings | None = None) -> HostSettings:
    """Hand this machine's settings to the libraries (the CLI does it first thing). Raises
    ValidationError naming the bad setting."""
    from datasets_prep import limits
    from datasets_prep import settings as data_settings
    from sandbox import settings as sandbox_settings
    from tasks import local_model

    host = host or HostSettings()
    # A library is configured when a setting differs from its default, or when it is
    # loaded already (a process that runs the CLI twice: the second run's settings win).
    sandbox = host.sandbox_host()
    if sandbox or "sandbox.settings" in sys.modules:
        from sandbox import settings as sandbox_settings

        sandbox_settings.configure(sandbox_settings.HostSettings(), **sandbox)
    data = host.changed(DATA_FIELDS)
    if data or "datasets_prep.settings" in sys.modules:
        from datasets_prep import settings as data_settings

        data_settings.configure(data_settings.DataSettings(), **data)
    if host.changed(LIMIT_FIELDS) or "datasets_prep.limits" in sys.modules:
        from datasets_prep import limits

        limits.configure(limits.DataLimits(**{f: getattr(host, f) for f in LIMIT_FIELDS}))
    if host.local_gguf is not None or "tasks.local_model" in sys.modules:
        from tasks import local_model

        local_model.configure(host.local_gguf)
    return host
