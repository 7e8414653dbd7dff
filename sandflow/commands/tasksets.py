"""`sandflow tasks ...`: the commands of the datasets_prep/ library (task sets, verifiers):

    sandflow tasks suites                       the built-in suites
    sandflow tasks prepare SOURCE --out F       a suite, hf:NAME, or a local file -> a task set
    sandflow tasks show F [-n 5]                a few tasks of a set
    sandflow tasks verifiers                    the verifier names
    sandflow tasks score F --id ID --answer A   check one answer (debugging a verifier)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from sandflow.errors import EXIT_USAGE, console, fail

tasks_app = typer.Typer(
    name="tasks",
    help=(
        "Task sets: build them from built-in suites, Hugging Face datasets or your own files; "
        "look inside; check answers.\n\n"
        "Examples:\n\n"
        "  sandflow tasks prepare smoke --out smoke.parquet\n\n"
        "  sandflow tasks prepare my_qa.jsonl --mapping context=passage,question=q,answer=a --out rl.parquet\n\n"
        "  sandflow tasks show smoke.parquet -n 3"
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
)


def _console() -> Any:
    return console()


def _fail(msg: str) -> None:
    raise fail(msg, EXIT_USAGE, stdout=True)


def _known_errors() -> tuple[type[BaseException], ...]:
    from datasets_prep.io import TaskSetIOError
    from datasets_prep.loaders import SourceError
    from datasets_prep.sources import SourceMissing
    from datasets_prep.suites import UnknownSuite
    from datasets_prep.task import TaskValidationError
    from datasets_prep.verifiers.base import VerifierError

    return (TaskValidationError, TaskSetIOError, SourceError, SourceMissing, UnknownSuite, VerifierError, ValueError)


@contextmanager
def _task_errors() -> Iterator[None]:
    """A task id the set does not have (KeyError, whose message is the sentence) or a
    task-set, source or verifier error: one sentence, exit 2, no traceback."""
    try:
        yield
    except KeyError as e:
        _fail(str(e.args[0]))
    except _known_errors() as e:
        _fail(str(e))


@tasks_app.command("suites")
def suites_cmd() -> None:
    """List the built-in suites (offline, deterministic given --seed and --size)."""
    from rich.table import Table

    from datasets_prep.suites import SUITES

    t = Table(title="Built-in suites", show_lines=False)
    t.add_column("name", style="bold cyan")
    t.add_column("default size", justify="right")
    t.add_column("domains")
    t.add_column("what")
    for s in SUITES.values():
        t.add_row(s.name, str(s.default_size), ", ".join(s.domains), s.description)
    _console().print(t)
    _console().print(
        "biomed and other domains without an offline source: bring a table with "
        "[bold]sandflow tasks prepare FILE --mapping ...[/] (see docs/datasets.md)."
    )


def summary_table(ts: Any) -> Any:
    from rich.table import Table

    from datasets_prep.task import human_bytes
    from sandflow.console import short

    s = ts.summary()
    h = short(_console(), s["content_hash"], 12)
    t = Table(title=f"{s['name']}: {s['count']} tasks  (content hash {h})")
    t.add_column("domain", style="bold")
    t.add_column("tasks", justify="right")
    t.add_column("types")
    t.add_column("files", justify="right")
    t.add_column("file bytes", justify="right")
    t.add_column("prompt chars (mean)", justify="right")
    domains: dict[str, list[Any]] = {}
    for task in ts.tasks:
        domains.setdefault(task.domain, []).append(task)
    for dom, items in sorted(domains.items()):
        types: dict[str, int] = {}
        for x in items:
            types[x.qa_type or "-"] = types.get(x.qa_type or "-", 0) + 1
        t.add_row(
            dom,
            str(len(items)),
            ", ".join(f"{k} {v}" for k, v in sorted(types.items())),
            str(sum(len(x.input_files) for x in items)),
            human_bytes(sum(x.input_bytes for x in items)),
            f"{sum(len(x.problem_statement) for x in items) / len(items):,.0f}",
        )
    t.add_section()
    t.add_row("total", str(s["count"]), "", str(s["files"]), human_bytes(s["file_bytes"]),
              f"{s['prompt_chars_mean']:,.0f}")
    return t


@tasks_app.command("prepare")
def prepare_cmd(
    source: str = typer.Argument(
        ...,
        help="A built-in suite (see `sandflow tasks suites`), hf:NAME\\[:CONFIG]\\[@SPLIT], or a local "
        ".parquet/.jsonl/.json/.csv file (task rows, or any question/answer table with --mapping).",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the set: .parquet or .jsonl."),
    seed: int = typer.Option(0, help="Seed for suites (same seed + size = same tasks, same hash)."),
    size: int | None = typer.Option(None, "--size", "--limit", "-n", help="Number of tasks (suites: default per suite; files: the first N rows)."),
    mapping: str | None = typer.Option(
        None,
        help="Treat SOURCE as a (context, question, answer[, choices]) table: role=column,... "
        "Roles: question, answer, context, context_path, choices, id, domain, qa_type, title.",
    ),
    domain: str = typer.Option("general", help="Domain for converted rows without a domain column."),
    qa_type: str | None = typer.Option(None, help="Answer type for converted rows (math, numeric, exact, open, single_choice, multi_choice, instruction)."),
    chunk_chars: int = typer.Option(20_000, help="Split a long context into files of about this many characters."),
    id_prefix: str = typer.Option("task", help="Prefix of ids made for converted rows without an id column."),
    name: str | None = typer.Option(None, help="Name recorded in the set (default: the suite or file name)."),
    peer: bool = typer.Option(False, "--peer", help="Write llm-in-sandbox rows (id, domain, problem_statement, ground_truth, input_files, qa_type)."),
) -> None:
    """Build a task set from SOURCE, validate all of it, write it atomically, print a summary.

    Nothing is written when any row fails validation; the error names the row and field."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

    from datasets_prep.io import write_taskset
    from datasets_prep.prepare import load_taskset

    console = _console()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    try:
        with Progress(*columns, console=console, transient=True) as bar:
            job = bar.add_task(f"preparing {source}", total=None)

            def advance(done: int, total: int) -> None:
                bar.update(job, completed=done, total=total, description=f"converting rows of {source}")

            ts = load_taskset(source, seed=seed, size=size, mapping=mapping, domain=domain, qa_type=qa_type,
                              chunk_chars=chunk_chars, id_prefix=id_prefix, name=name, progress=advance)
            bar.update(job, description=f"writing {out}")
            write_taskset(ts, out, peer=peer)
    except _known_errors() as e:
        _fail(str(e))
    console.print(summary_table(ts))
    console.print(f"wrote [bold]{out}[/] ({'peer rows' if peer else 'sandflow task set'}, {len(ts)} tasks)")


@tasks_app.command("show")
def show_cmd(
    file: Path = typer.Argument(..., help="A task set (.parquet or .jsonl; sandflow's or peer rows)."),
    n: int = typer.Option(5, "-n", help="How many tasks to print."),
    task_id: str | None = typer.Option(None, "--id", help="Print only this task."),
    full: bool = typer.Option(False, help="Print whole prompts and file heads, not one line each."),
) -> None:
    """Print a set's summary and its first N tasks (prompt, ground truth, files, verifier)."""
    from rich.markup import escape
    from rich.panel import Panel

    from datasets_prep.io import read_taskset
    from datasets_prep.task import content_size, human_bytes
    from datasets_prep.verifiers import choose
    from sandflow.console import fits

    console = _console()
    with _task_errors():
        ts = read_taskset(file)
        chosen = [ts.by_id(task_id)] if task_id else ts.tasks[:n]
    console.print(summary_table(ts))
    for t in chosen:
        prompt = t.problem_statement if full else _clip(t.problem_statement, 300)
        files = "\n".join(
            f"  {escape(k)}  ({human_bytes(content_size(v))})" + (f"\n    {escape(_clip(str(v), 200))}" if full else "")
            for k, v in list(t.input_files.items())[:20]
        )
        body = (
            f"[bold]domain[/] {escape(t.domain)}   [bold]type[/] {escape(str(t.qa_type))}   "
            f"[bold]verifier[/] {escape(choose(t))}\n\n{escape(prompt)}\n\n"
            f"[bold]ground truth[/] {escape(_clip(str(t.ground_truth), 200))}"
            + (f"\n[bold]files[/] ({len(t.input_files)}, in {escape(t.input_dir)})\n{files}" if t.input_files else "")
        )
        console.print(Panel(body, title=escape(t.id), title_align="left", expand=fits(console)))


def _clip(s: str, n: int) -> str:
    s = s.replace("\n", " ⏎ ") if n < 1000 else s
    return s if len(s) <= n else s[: n - 1] + "…"


@tasks_app.command("verifiers")
def verifiers_cmd() -> None:
    """List the verifiers (rewards) by name; `auto` picks one per task."""
    from rich.table import Table

    from datasets_prep.verifiers import available

    t = Table(title="Verifiers: (answer, ground_truth, task) -> score in [0,1] + reason")
    t.add_column("name", style="bold cyan")
    t.add_column("what")
    for k, v in available().items():
        t.add_row(k, v)
    _console().print(t)


@tasks_app.command("score")
def score_cmd(
    file: Path = typer.Argument(..., help="A task set."),
    task_id: str = typer.Option(..., "--id", help="The task to score against."),
    answer: str = typer.Option(..., help="The answer text (use @path to read it from a file)."),
    verifier: str | None = typer.Option(None, help="A verifier name (default: auto)."),
) -> None:
    """Check one answer against one task and print the score and reason."""
    from datasets_prep.io import read_taskset
    from datasets_prep.verifiers import choose, score
    from sandflow.config import load_settings

    with _task_errors():
        ts = read_taskset(file)
        task = ts.by_id(task_id)
        text = Path(answer[1:]).read_text(encoding="utf-8") if answer.startswith("@") else answer
        judge = load_settings().judge_endpoint() if verifier == "judge" else None
        r = score(task, text, verifier, judge=judge)
    color = "green" if r.score >= 1 else ("yellow" if r.score > 0 else "red")
    _console().print(f"[bold {color}]{r.score:.3f}[/]  {r.verifier or choose(task)}: {r.reason}")


def register(app: typer.Typer) -> None:
    """Add this room's commands to the main app."""
    app.add_typer(tasks_app, name="tasks")
