"""`sandflow`: the one CLI. Every command lives in sandflow/commands/, one module per
group (the libraries below have no CLI of their own):

    commands/episode.py    run, serve                  (tasks/)
    commands/tasksets.py   tasks ...                   (datasets_prep/)
    commands/sandbox.py    image ..., sandbox ...      (sandbox/)
    commands/sql.py        sql, warehouse ...          (warehouse/)
    commands/pipeline.py   bench, flows ...            (flows/, analysis/)
    commands/rl.py         rl ...                      (rl/)
    commands/data.py       data ...                    (datagen/, flows/data.py)
    commands/compare.py    compare                     (analysis/, warehouse/)
    commands/interop.py    export ..., import ...      (interop/)
    viewer/cli.py          view                        (the web viewer, sandflow/viewer/)

Command modules import their heavy dependencies (docker, prefect, duckdb) inside the
command bodies, so `sandflow --help` stays fast. Errors: sandflow/errors.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from pydantic import ValidationError

app = typer.Typer(
    name="sandflow",
    help=(
        "LLM-in-Sandbox as a data pipeline: give a model a virtual computer, record every turn, "
        "query with SQL, build RL rollouts.\n\n"
        "Start here:  sandflow run --query 'What is 2**100?'   |   sandflow bench --suite smoke   |   "
        "sandflow sql"
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)


def _register() -> None:
    from sandflow.commands import (
        compare,
        data,
        episode,
        interop,
        pipeline,
        rl,
        sandbox,
        sql,
        tasksets,
        train,
    )

    for module in (sandbox, episode, sql, tasksets, pipeline, rl, data, compare, interop, train):
        module.register(app)


    from sandflow.viewer import cli as viewer_cli

    viewer_cli.register(app)  # `sandflow view` (the web viewer is its own package)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"sandflow {version('sandflow')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """LLM-in-Sandbox as a data pipeline."""
    _hand_settings_down()


def _hand_settings_down() -> None:
    """This machine's settings (SANDFLOW_*, sandflow.toml) to the libraries, before any
    command runs (sandflow/host.py); a bad one stops here, named, with exit code 2. The
    Prefect defaults go into the environment here too, before anything imports prefect
    (the processes the CLI starts inherit them; no library import sets them)."""
    from pydantic import ValidationError

    from flows import prefect_env
    from sandflow.host import apply_host_settings

    prefect_env.apply()
    try:
        apply_host_settings()
    except ValidationError as exc:
        _bad_setting(exc)
    except (ValueError, OSError):
        pass  # an unreadable config file: the command that needs it says so (`sql` does not)


def _bad_setting(exc: ValidationError) -> NoReturn:
    """One sentence naming the setting, its value and what is wrong; exit code 2."""
    from sandflow.errors import fail

    err = exc.errors()[0]
    name = ".".join(map(str, err["loc"]))
    msg = str(err["msg"]).removeprefix("Value error, ")
    raise fail(
        f"invalid setting {name} (SANDFLOW_{name.upper()} or sandflow.toml): "
        f"{err.get('input')!r} is not valid: {msg}"
    ) from None


_register()


def main() -> None:
    from sandflow.console import plain_usage_errors

    plain_usage_errors()  # off a terminal: typer's own errors on one line, never wrapped
    app()


if __name__ == "__main__":
    main()
