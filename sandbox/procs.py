"""Host processes by pid: is one alive, stop one. The one home of `os.kill(pid, 0)`.

Used for the daemons sandflow starts (squid, ulogd, the bulk relays) and for lock holders
(warehouse/runlock.py). A pid file that is missing, empty or not a number is "not alive".
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists (another user's process counts: EPERM)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_pid(pid_file: Path) -> int | None:
    """The pid a pid file names, or None (missing, unreadable, not a positive number)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def pid_file_alive(pid_file: Path, comm: str | None = None) -> bool:
    """The pid file names a live process (whose /proc comm is `comm`, when given: a pid
    reused by another program is not our daemon)."""
    pid = read_pid(pid_file)
    if pid is None or not pid_alive(pid):
        return False
    if comm is None:
        return True
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == comm
    except OSError:
        return False


def stop_pid(pid: int, timeout_s: float = 5.0) -> bool:
    """SIGTERM `pid` and wait up to `timeout_s` for it to go; True when it is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return not pid_alive(pid)
