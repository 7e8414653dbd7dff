"""One error convention for every command: one sentence on stderr, a documented exit code.

Every command reports a problem the user can fix through `fail`: ``error: <sentence>`` in
red on stderr (never a traceback as the only clue), and exits with one of these codes:

    0    done
    1    EXIT_FAILED       the work ran and failed: a query, a check that found bad files, a
                           `flows`/`bench` step (whatever stopped it, bad input included: the
                           flow found it while running), a `flows run`/`bench` run with
                           episodes that failed after their retries
    2    EXIT_USAGE        bad input caught before any work: a flag, a file, a source, a
                           setting; nothing was changed
    3    EXIT_INFRA        the model endpoint or the sandbox failed mid-episode (`sandflow run`);
         EXIT_REGRESSION   `bench --fail-on-regression`: accuracy dropped significantly
    130  EXIT_INTERRUPTED  Ctrl+C / SIGTERM; resume with the same --run-id

Results go to stdout through `console()`, so `sandflow sql ... --format csv > f` stays clean.
Two wrinkles are kept as they always were, because scripts (and tests) read them: the
`sandflow tasks ...` commands print their error line on stdout beside their tables
(`stdout=True`), and `sandflow run` / `serve` spell it ``Error:`` as click does
(`label="Error"`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INFRA = 3
EXIT_REGRESSION = 3
EXIT_INTERRUPTED = 130


def console() -> Console:
    """The console for results (stdout): sandflow.console, which never wraps off a terminal."""
    from sandflow import console as term

    return term.console()


def err_console() -> Console:
    """The console for errors, warnings and progress notes (stderr)."""
    from sandflow import console as term

    return term.err_console()


def fail(
    message: str, code: int = EXIT_USAGE, *, stdout: bool = False, label: str = "error"
) -> typer.Exit:
    """Print ``error: message`` on stderr and return the Exit to raise: ``raise fail(...)``."""
    from rich.markup import escape

    out = console() if stdout else err_console()
    out.print(f"[bold red]{label}:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


def warn(message: str) -> None:
    """A problem that does not stop the command (a bad file left out, a skipped step)."""
    from rich.markup import escape

    err_console().print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)
