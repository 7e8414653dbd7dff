"""The one `--durability` option of `flows run`, `bench` and `rl serve`.

It picks what a recorded run survives (warehouse.journal.Durability); the default comes
from SANDFLOW_DURABILITY or `durability` in sandflow.toml (sandflow.config.Settings), then
"turn". typer checks the value against the three names, exit code 2 on anything else.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import typer


class DurabilityChoice(StrEnum):
    turn = "turn"
    sync = "sync"
    flush = "flush"


DURABILITY_HELP = (
    "What the recording survives. [bold]turn[/] (default): an OS crash loses at most an open "
    "episode's last 4 records (fsynced in the background within milliseconds). "
    "[bold]sync[/]: nothing (an fsync per turn, slowest). [bold]flush[/]: recent records "
    "(nothing waits for the disk, fastest). A kill -9 loses nothing in every mode. "
    "Also SANDFLOW_DURABILITY or `durability` in sandflow.toml."
)


def durability_option() -> Any:
    return typer.Option(None, "--durability", help=DURABILITY_HELP, case_sensitive=False)


def durability_value(choice: DurabilityChoice | None) -> str | None:
    """The flag's value as Settings takes it; None: not given (the setting decides)."""
    return None if choice is None else choice.value
