"""The application's one way to print: rich consoles for results (stdout) and notes
(stderr), and the width a table cell may take.

Why one module: on a terminal rich fits output to the window, which is what a person
wants. Anywhere else (a pipe, a file, CI logs, a test runner) rich assumes 80 columns
(or $COLUMNS) and wraps or cuts whatever does not fit, so a bad file's path reached a
script in two pieces and a test failed on a machine whose temporary paths were longer
(issue #22.13). Here, when the stream is not a terminal, nothing is wrapped or cut: text
is printed as is (soft wrap) and tables are as wide as their content. Every command
builds its consoles through `console()` / `err_console()`, never `rich.Console()`.

Renderables that fill the width by design (a panel, a rule) fill only what they need
there: `fits(console)` is the ``expand`` a panel should get, and `rule()` draws a
terminal-wide rule or a short one. The errors typer prints itself (a bad flag value, a
missing --input-dir) go through `plain_usage_errors`: click's own one-line ``Error:``
when stderr is not a terminal, typer's panel on a terminal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# The width rich lays out to when the output is not a terminal: beyond any line sandflow
# prints, so nothing wraps. Tables and soft-wrapped text take only the width they need.
UNBOUNDED_WIDTH = 1_000_000
RULE_WIDTH = 80  # a rule's width off a terminal (a rule says nothing that could be cut)


def _make(stderr: bool) -> Console:
    from rich.console import Console

    c = Console(stderr=stderr, highlight=False)
    if c.is_terminal:
        return c
    return Console(stderr=stderr, highlight=False, width=UNBOUNDED_WIDTH, soft_wrap=True)


def console() -> Console:
    """The console for results (stdout)."""
    return _make(stderr=False)


def err_console() -> Console:
    """The console for errors, warnings and progress notes (stderr)."""
    return _make(stderr=True)


def fits(c: Console) -> bool:
    """Whether a panel on `c` may take the whole width (only on a terminal: elsewhere
    the width is unbounded and a panel fits its content)."""
    return c.is_terminal


def rule(c: Console, title: str = "") -> None:
    """A horizontal rule with a title: terminal-wide, or RULE_WIDTH columns elsewhere."""
    from rich.rule import Rule

    c.print(Rule(title), width=None if c.is_terminal else RULE_WIDTH)


def short(c: Console, text: str, n: int) -> str:
    """An id or hash shortened to `n` characters for a person at a terminal (like git's
    short hashes); whole anywhere else, where a script may need all of it."""
    return text[:n] if c.is_terminal else text


def cell_width(c: Console, asked: int | None, default: int) -> int | None:
    """How many characters a table cell may show: what the user asked, else `default` on
    a terminal and no limit elsewhere (an id or path is never cut in a pipe)."""
    if asked is not None:
        return asked
    return default if c.is_terminal else None


def plain_usage_errors() -> None:
    """Off a terminal, print typer's usage errors as click does (``Error: <message>`` on
    one line) instead of in a rich panel wrapped at $COLUMNS. Installed by the `sandflow`
    entry point (sandflow.cli.main) before the command line is parsed."""
    import sys

    from typer import rich_utils

    panel = getattr(rich_utils, "rich_format_error", None)
    if panel is None or getattr(panel, "_sandflow_plain", False):
        return

    def format_error(exc: Any) -> None:
        if sys.stderr.isatty():
            panel(exc)
        else:
            exc.show()

    format_error._sandflow_plain = True  # type: ignore[attr-defined]
    rich_utils.rich_format_error = format_error  # type: ignore[assignment]
