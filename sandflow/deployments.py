"""The entry points of prefect.yaml's deployments: the nightly flows as a Prefect worker
runs them, without the CLI.

A worker's flow run imports this module, not the CLI, so importing it does what the CLI
does when it starts: Prefect's defaults into the environment before prefect is imported
(flows/prefect_env.py), then this machine's settings (SANDFLOW_*, sandflow.toml) handed
to the libraries (sandflow/host.py). The flows themselves live in flows/nightly.py, flows/data.py and flows/train.py.
"""

from __future__ import annotations

from flows import prefect_env

prefect_env.apply()

from sandflow.host import apply_host_settings  # noqa: E402

apply_host_settings()

from flows.data import data_build_job  # noqa: E402
from flows.nightly import nightly_flow, rl_data_flow  # noqa: E402
from flows.train import train_flow  # noqa: E402

__all__ = ["data_build_job", "nightly_flow", "rl_data_flow", "train_flow"]
