"""Run a helper server that must not outlive the process that started it.

    python -m flows.deathwatch OWNER_PID -- COMMAND [ARGS...]

`sandflow flows run` / `bench` start Prefect API servers as child processes (Prefect's own
ephemeral server; the temporary server for Dask runs, flows/prefect_server.py). Both are
started in their own session, so that a terminal's Ctrl+C reaches the run first and the
run can stop them in order. But after a kill -9 of the run nothing stops them: they kept
running forever (issue #11). This wrapper closes that gap:

- It watches OWNER_PID through a pidfd (Linux 5.3+; else it polls its parent pid): the
  moment the owner is gone, for any reason, it stops COMMAND (SIGTERM, SIGKILL after
  STOP_GRACE_S) and exits.
- COMMAND gets SIGKILL as its parent-death signal from this wrapper, which is single-
  threaded, so the signal is tied to the wrapper's life (a parent-death signal follows the
  *thread* that forked, which is why it is not set in the multi-threaded owner itself):
  if the wrapper is SIGKILLed, COMMAND dies too.
- SIGTERM / SIGINT to the wrapper (the owner stopping its server normally) are passed on
  to COMMAND; the wrapper exits with COMMAND's exit status (Prefect reads status 3 as
  "port in use, try another").

Standard library only, so it starts fast and imports nothing of Prefect.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1


def wrap(argv: list[str], owner: int | None = None) -> list[str]:
    """`argv` run under the watch of `owner` (default: this process)."""
    return [sys.executable, "-m", "flows.deathwatch", str(owner or os.getpid()), "--", *argv]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _owner_watch(owner: int) -> int | None:
    """A pidfd that becomes readable when `owner` exits (None: poll the parent pid)."""
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):
        return None
    return fd


def _owner_gone(owner: int, pidfd: int | None) -> bool:
    if pidfd is not None:
        readable, _, _ = select.select([pidfd], [], [], 0)
        return bool(readable)
    return os.getppid() != owner


def _stop(child: subprocess.Popen[bytes]) -> int:
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        return child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m flows.deathwatch OWNER_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    owner = int(argv[0])
    command = argv[2:]
    pidfd = _owner_watch(owner)
    if os.getppid() != owner:  # the owner died before we could watch it (or is not our parent)
        return 1
    stop_requested: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(command, preexec_fn=_die_with_parent)  # noqa: PLW1509
    while True:
        code = child.poll()
        if code is not None:
            return code if code >= 0 else 128 - code
        if stop_requested:
            code = _stop(child)
            return code if code >= 0 else 128 - code
        if _owner_gone(owner, pidfd):
            _stop(child)
            return 1
        if pidfd is not None:
            with contextlib.suppress(InterruptedError):
                select.select([pidfd], [], [], 0.2)
        else:
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
