"""`sandflow`: one CLI over the library. Each room registers its own commands.

Sub-modules import their heavy dependencies (docker, prefect, duckdb) inside the
command bodies, so `sandflow --help` stays fast.
"""

from __future__ import annotations

import typer

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
    from datasets_prep import cli as datasets_cli
    from flows import cli as flows_cli
    from sandbox import cli as sandbox_cli
    from tasks import cli as tasks_cli
    from warehouse import cli as warehouse_cli

    for module in (sandbox_cli, tasks_cli, warehouse_cli, datasets_cli, flows_cli):
        module.register(app)

    from sandflow.viewer import cli as viewer_cli

    viewer_cli.register(app)  # `sandflow view`

    from sandflow import rl_cli

    rl_cli.register(app)

    from sandflow import compare_cli

    compare_cli.register(app)  # `sandflow compare`




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


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
