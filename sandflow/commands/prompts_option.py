"""The one `--prompts` option of `sandflow run`, `bench` and `train`.

A prompt set names the prompts AND the tools an episode offers (tasks/prompts.py: a
folder's general.yaml, its `tools:` key): `sandflow` (the paper's), `small` (short, with
`submit(answer)`, for small policies) or a folder of YAML files. A policy trained on one set
is benchmarked on the same (`bench --checkpoint` takes the set its training recorded), so
the comparison measures the policy, not a contract it never saw. A bad value stops the
command at once (exit 2), naming the folder.
"""

from __future__ import annotations

from typing import Any

import typer

PROMPTS_HELP = (
    "The prompt set: [bold]sandflow[/] (default: the paper's prompts and tools), "
    "[bold]small[/] (short prompts with submit(answer), for small policies) or a folder of "
    "prompt YAML files (general.yaml, <domain>.yaml; `tools:` in general.yaml picks the tool set)."
)


def prompt_dir_of(prompts: str | None) -> str | None:
    """`--prompts` (a set's name or a folder) as a RunSpec's `prompt_dir`; a bad one stops
    the command with one sentence naming the folder (exit 2), before anything starts."""
    from sandflow.errors import EXIT_USAGE, fail
    from tasks.prompts import load_prompts, resolve_prompts

    try:
        folder = resolve_prompts(prompts)
        load_prompts("general", folder)
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    return folder


def prompts_option(default: str | None = None) -> Any:
    """A fresh `--prompts` option (`--prompt-dir` is its older name)."""
    return typer.Option(default, "--prompts", "--prompt-dir", metavar="SET|DIR", help=PROMPTS_HELP)
