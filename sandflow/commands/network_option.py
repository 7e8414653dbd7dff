"""The one `--network` option of `sandflow run`, `flows run`, `bench` and `sandbox exec`.

The value is one policy string in the syntax every other place takes (SANDFLOW_NETWORK,
`network` in sandflow.toml, a task's `metadata.network`, `SandboxLimits(network=...)`):
sandbox.netpolicy.parse_network is its one parser. A bad value stops the command at
once, before any model, sandbox or Prefect flow starts, naming the bad entry.
"""

from __future__ import annotations

from typing import Any

import typer

NETWORK_HELP = (
    "Sandbox network policy. [bold]none[/] (default): no network. "
    "[bold]allowlist:ENTRIES[/]: only the listed destinations, through the recording egress "
    "proxy, e.g. [cyan]--network 'allowlist:pypi.org *.pythonhosted.org:443'[/] "
    "(an entry is a hostname, *.domain, an IP or CIDR, optionally :PORTS such as 443, 80,443 "
    "or 8000-8010, default 80,443; entries separated by spaces or ';'). "
    "[bold]open[/]: any host through the same proxy (still recorded; loopback, private and "
    "metadata addresses refused). [bold]bridge[/]: raw and unrecorded. "
    "Also SANDFLOW_NETWORK or `network` in sandflow.toml."
)


def check_network(value: str | None) -> str | None:
    """typer callback: the policy string checked now (typer reports `Invalid value for
    '--network': ...` with the reason, exit code 2)."""
    if value is None:
        return None
    from sandbox.netpolicy import PolicyError, parse_network

    try:
        parse_network(value)
    except PolicyError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value.strip()


def network_option(envvar: str | None = None) -> Any:
    """A fresh `--network` option (typer options are not shared between commands);
    `envvar` for commands that read SANDFLOW_NETWORK themselves (no settings)."""
    return typer.Option(
        None,
        "--network",
        metavar="POLICY",
        callback=check_network,
        help=NETWORK_HELP,
        envvar=envvar,
    )
