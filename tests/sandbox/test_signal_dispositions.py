"""The sandbox registry's signal handlers respect a signal the process ignores.

A background job started by a non-interactive shell (`cmd &`, cron, some CI runners)
inherits SIGINT ignored. The registry used to install its handler anyway, so a stray
SIGINT removed every sandbox of a run that then went on (its episodes failing as
`sandbox_error`). An ignored signal stays ignored; the others get the handler."""

from __future__ import annotations

import signal
import subprocess
import sys

PROBE = """
import signal
from sandbox.registry import install_signal_handlers, _handler
install_signal_handlers()
print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is _handler)
"""


def _run(ignore_sigint: bool) -> str:
    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=preexec,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_an_ignored_sigint_stays_ignored() -> None:
    assert _run(ignore_sigint=True) == "True True"


def test_a_default_sigint_gets_the_handler() -> None:
    assert _run(ignore_sigint=False) == "False True"
