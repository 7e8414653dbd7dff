"""`sandflow export atif|inspect|hf|harbor` and `sandflow import llm-in-sandbox|harbor`: sandflow with the
tools people already have (interop/; docs/interop.md). Thin: parse, call the library,
print its one-line summary (what was written, what could not be carried over).

Exit codes: 2 for bad input found before any work (an unknown run or episode, a folder
that is not the peer's output or an RL set, a malformed field: one sentence naming it),
1 when the work failed (a hub upload).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from sandflow.errors import EXIT_FAILED, EXIT_USAGE, console, err_console, fail

WAREHOUSE_HELP = "Warehouse root. Default: SANDFLOW_WAREHOUSE, sandflow.toml, ./warehouse_data."


def _root(warehouse: Path | None) -> Path:
    if warehouse is not None:
        return warehouse
    from sandflow.config import settings_warehouse

    return settings_warehouse()


def _report(summary: object) -> None:
    from interop.summary import Summary

    assert isinstance(summary, Summary)
    console().print(summary.line(), soft_wrap=True, markup=False)
    for bad in summary.extra.get("skipped_files") or []:
        err_console().print(f"[yellow]warning:[/] bad warehouse file left out: {bad}", soft_wrap=True, markup=False)


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from interop.hf import RLSetError
    from interop.names import OutputPathError
    from interop.peer_import import PeerFormatError
    from warehouse.query import WarehouseError

    return (WarehouseError, PeerFormatError, RLSetError, OutputPathError, ValueError)


@contextmanager
def _bad_input() -> Iterator[None]:
    """The library's bad-input errors (an unknown run or episode, a folder of the wrong
    kind, a malformed field) become their one sentence and exit 2, with no traceback."""
    try:
        yield
    except _bad_input_errors() as exc:
        raise fail(str(exc), EXIT_USAGE) from None


export_app = typer.Typer(
    name="export",
    help="Write a run for other tools: ATIF trajectories (Harbor), Inspect AI eval logs, Hugging Face datasets; a task set as Harbor tasks.",
    no_args_is_help=True,
)
import_app = typer.Typer(
    name="import",
    help="Bring other tools' output into the warehouse: llm-in-sandbox output folders, Harbor trials.",
    no_args_is_help=True,
)

_OUT = typer.Option(..., "--out", "-o", help="Output folder (created if missing).")
_WH = typer.Option(None, "--warehouse", "-w", help=WAREHOUSE_HELP)


@export_app.command("atif")
def export_atif_cmd(
    run: str = typer.Argument(..., help="Run id."),
    out: Path = _OUT,
    episode: str | None = typer.Option(None, "--episode", "-e", help="Only this episode id."),
    warehouse: Path | None = _WH,
) -> None:
    """One ATIF trajectory (Agent Trajectory Interchange Format, v1.8) per episode:
    <out>/<episode id>.json, valid under the harbor package's models and validator.

    [bold]Example[/]
      sandflow export atif RUN --out atif/
      sandflow export atif RUN --episode 1c8952beba6b5be57e62 --out one/
    """
    from interop.atif import export_atif

    with _bad_input():
        summary = export_atif(_root(warehouse), run, out, episode_id=episode)
    _report(summary)


@export_app.command("harbor")
def export_harbor_cmd(
    taskset: str = typer.Argument(..., help="A task set: a built-in suite, a task-set file, a table."),
    out: Path = _OUT,
    seed: int = typer.Option(0, "--seed", help="Seed of a built-in suite."),
    size: int | None = typer.Option(None, "--size", min=1, help="Tasks of a built-in suite."),
    image: str | None = typer.Option(None, "--image", help="Base image (default: sandflow's sandbox image, SANDFLOW_IMAGE)."),
    network: str = typer.Option(
        "no-network", "--network", help="The tasks' network_mode: no-network (Harbor's docker environment enforces it with an egress sidecar pulled from Docker Hub) or public."
    ),
) -> None:
    """One Harbor task directory per task (instruction.md, task.toml, environment/ on
    sandflow's image, tests/, solution/), loadable by harbor's own task loader.

    [bold]Example[/]
      sandflow export harbor math --size 20 --out harbor-math/
      sandflow export harbor math.parquet --network public --out suite/
      harbor run -p suite/ -a oracle                # docker compose v2+ (docs/interop.md)
    """
    from datasets_prep.prepare import load_taskset
    from datasets_prep.verifiers import VerifierError
    from interop.harbor import export_harbor
    from sandbox.image import DEFAULT_SPEC
    from sandflow.config import load_settings

    settings = load_settings(image=image)
    with _bad_input():
        try:
            ts = load_taskset(taskset, seed=seed, size=size)
            summary = export_harbor(ts, out, image=settings.image or DEFAULT_SPEC.tag, network=network)
        except VerifierError as exc:
            raise ValueError(str(exc)) from None
    _report(summary)


@export_app.command("inspect")
def export_inspect_cmd(
    run: str = typer.Argument(..., help="Run id."),
    out: Path = _OUT,
    warehouse: Path | None = _WH,
) -> None:
    """Inspect AI eval logs, one per task set and mode (<out>/<run>_<mode>.eval): samples
    are episodes with their messages, tool calls, scores and token usage.

    [bold]Example[/]
      sandflow export inspect RUN --out logs/ && inspect view --log-dir logs/
    """
    from interop.inspect_log import export_inspect

    with _bad_input():
        summary = export_inspect(_root(warehouse), run, out)
    _report(summary)


@export_app.command("hf")
def export_hf_cmd(
    source: str = typer.Argument(..., help="A run id, or an RL set folder (what `sandflow flows rollouts` writes)."),
    out: Path = _OUT,
    push: str | None = typer.Option(
        None, "--push", help="Then upload the folder to this hub dataset repository (NAME/REPO); needs the hub and a token (HF_TOKEN or `huggingface-cli login`)."
    ),
    public: bool = typer.Option(False, "--public", help="With --push: create the repository public (default private)."),
    warehouse: Path | None = _WH,
) -> None:
    """A Hugging Face dataset folder: Parquet splits (a run: one per mode; an RL set: one
    config per table) and a dataset card README.md with the schema, counts and provenance.
    `datasets.load_dataset(OUT)` loads it offline.

    [bold]Examples[/]
      sandflow export hf RUN --out ds/
      sandflow export hf warehouse_data/exports/RUN --out ds-rl/ --push me/sandflow-rollouts
    """
    from interop.hf import HubError, export_hf_rlset, export_hf_run, is_rlset, push_to_hub

    with _bad_input():
        if Path(source).is_dir():
            if not is_rlset(source):
                raise fail(
                    f"{source} is a folder but not an RL set (no trajectories/taskset/tokens.parquet); "
                    "give a run id or the folder `sandflow flows rollouts` wrote",
                    EXIT_USAGE,
                )
            summary = export_hf_rlset(source, out)
        else:
            summary = export_hf_run(_root(warehouse), source, out)
    _report(summary)
    if push:
        try:
            url = push_to_hub(out, push, private=not public)
        except HubError as exc:
            raise fail(str(exc), EXIT_FAILED) from None
        console().print(f"pushed to {url}", soft_wrap=True, markup=False)


@import_app.command("llm-in-sandbox")
def import_peer_cmd(
    folder: Path = typer.Argument(..., help="An llm-in-sandbox output folder, or a folder of them."),
    run_id: str | None = typer.Option(None, "--run-id", "-r", help="Run id (default: peer-<folder name>)."),
    tasks: str | None = typer.Option(
        None, "--tasks", help="The sandflow task set the peer ran (its verifiers score; `compare` pairs by its hash)."
    ),
    max_problem_bytes: int | None = typer.Option(
        None, "--max-problem-bytes", min=1, help="The most JSON text of one problem that is parsed, bounding the memory (default 16 MiB)."
    ),
    warehouse: Path | None = _WH,
) -> None:
    """Record llm-in-sandbox 0.2.0 output (trajectory.json, results.json, logs/) as a run,
    scored by sandflow's verifiers; then `sandflow sql`, `sandflow view` and
    `sandflow compare SANDFLOW_RUN PEER_RUN` work on it.

    [bold]Example[/]
      sandflow import llm-in-sandbox output/ --tasks math.parquet --run-id peer-math
    """
    from interop.peer_import import import_peer

    ts = None
    if tasks is not None:
        from datasets_prep.prepare import load_taskset

        try:
            ts = load_taskset(tasks)
        except Exception as exc:  # the loader's errors name the file/row; one sentence
            raise fail(f"--tasks {tasks}: {exc}", EXIT_USAGE) from None
    with _bad_input():
        bound = {"max_problem_bytes": max_problem_bytes} if max_problem_bytes else {}
        summary = import_peer(_root(warehouse), folder, run_id=run_id, tasks=ts, **bound)
    _report_scored(summary, "the peer's")


@import_app.command("harbor")
def import_harbor_cmd(
    folder: Path = typer.Argument(..., help="A Harbor job folder (what `harbor run --jobs-dir` writes per job), or one trial folder."),
    tasks: str = typer.Option(
        ..., "--tasks", help="The sandflow task set that `sandflow export harbor` wrote (its verifiers score; `compare` pairs by it)."
    ),
    run_id: str | None = typer.Option(None, "--run-id", "-r", help="Run id (default: harbor-<folder name>)."),
    seed: int = typer.Option(0, "--seed", help="Seed of a built-in suite (as given to the export)."),
    size: int | None = typer.Option(None, "--size", min=1, help="Tasks of a built-in suite (as given to the export)."),
    warehouse: Path | None = _WH,
) -> None:
    """Record Harbor trials (result.json, the agent's ATIF trajectory, the verifier's
    reward and the kept answer) as a run, scored by sandflow's verifiers; then
    `sandflow compare HARBOR_RUN SANDFLOW_RUN` pairs them task by task.

    [bold]Example[/]
      sandflow export harbor math.parquet --out suite/
      harbor run -p suite/ -a oracle -o jobs/ --job-name oracle
      sandflow import harbor jobs/oracle --tasks math.parquet --run-id harbor-oracle
    """
    from datasets_prep.prepare import load_taskset
    from interop.atif_import import import_harbor

    try:
        ts = load_taskset(tasks, seed=seed, size=size)
    except Exception as exc:  # the loader's errors name the file/row; one sentence
        raise fail(f"--tasks {tasks}: {exc}", EXIT_USAGE) from None
    with _bad_input():
        summary = import_harbor(_root(warehouse), folder, tasks=ts, run_id=run_id)
    _report_scored(summary, "Harbor's")


def _report_scored(summary: object, whose: str) -> None:
    """An import's summary, then how sandflow's verifiers scored it against `whose` reward."""
    from interop.summary import Summary

    _report(summary)
    assert isinstance(summary, Summary)
    x = summary.extra
    console().print(
        f"run {x['run_id']}: {x['scored']} scored by sandflow's verifiers "
        f"({x['agree_with_peer']} agree with {whose} reward, {x['disagree_with_peer']} differ)",
        soft_wrap=True,
        markup=False,
    )
    for p in x.get("scoring_problems") or []:
        err_console().print(f"[yellow]warning:[/] {p}", soft_wrap=True, markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, rich_help_panel="Results")
    app.add_typer(import_app, rich_help_panel="Results")
