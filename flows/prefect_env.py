"""Prefect settings that suit sandflow, applied in ONE place before prefect is imported.

Prefect reads its settings when it is first imported, so `apply()` must run before
any `import prefect`. The CLI calls it first thing; flows/__init__ imports nothing
from prefect so importing `flows` alone never freezes the settings too early.

Why each setting (measured on a 2-core host, see docs/pipeline.md):
- Ephemeral mode starts a local API server as a subprocess; with a fresh
  PREFECT_HOME its migrations take ~15 s, above the default 20 s budget on a busy
  host. 90 s keeps `sandflow bench` from failing on a slow first start.
- Analytics off and DO_NOT_TRACK: the machine may be offline; never phone home.
- The server records each task run at ~35-50 ms unless its recorder and event
  persister batch; with these batch sizes it is ~15 ms, which is what keeps
  Prefect's overhead a small fraction of an episode. Its automation triggers are off
  (a server sandflow starts lives for one run and has no automations).
User-set values always win (setdefault): a real server, a real PREFECT_HOME.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

PREFECT_DEFAULTS: dict[str, str] = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "500",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE": "500",
    # The servers sandflow starts (ephemeral, or the one per Dask run) live for one run:
    # no automation is defined on them, yet their triggers service evaluated every task
    # run's events (~1/5 of the server's CPU per episode on the peer benchmark; the server
    # competes with the episodes for the same cores). A real server (PREFECT_API_URL) is
    # not affected; set it to "true" to keep automations on a sandflow-started server.
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    # Flow logs to the API are batched already; keep the terminal for our progress bars.
    "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "2.0",
    # Episode results live in the warehouse, not in Prefect's result store.
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
    # Dask workers sample every thread's stack every 10 ms (sys._current_frames). On
    # CPython 3.11 that can deadlock the whole worker: the call holds the runtime lock
    # while allocating frames, a GC pass it triggers frees a threading.local, and its
    # dealloc waits for the same lock with the GIL held (every thread stops for good; seen
    # as a Dask load run stalled at 184/200 with idle CPUs). Episodes don't need the profiler.
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    # Ray (--task-runner ray) never phones home either.
    "RAY_USAGE_STATS_ENABLED": "0",
    # Offline hosts: Hugging Face loaders must fail at once, not retry for 23 s.
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
}


def apply(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Set the defaults (without overriding the user's) and return what is in effect."""
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    for key, value in (overrides or {}).items():
        os.environ[key] = value
    return {k: os.environ[k] for k in PREFECT_DEFAULTS}


def detach_ephemeral_server() -> None:
    """Start Prefect's ephemeral API server in its own session, tied to this process (CLI).

    Ctrl+C in a terminal signals the whole foreground process group. The ephemeral
    server is a child in that group, so it died at once and the interrupted run could
    not report its own stop: ~80 s of event retries, then a ConnectError traceback
    (found by tests/chaos: SIGINT to the process group). In its own session it only
    gets the terminate Prefect sends it at exit. But then nothing stopped it after a
    kill -9 of the run (issue #11: it ran on forever), so it runs under flows.deathwatch,
    which stops it the moment this process is gone. No-op with a real server
    (PREFECT_API_URL).

    Its output goes to a log file (`server_log_path()`), not to the run's terminal:
    when a run is stopped, the server is terminated mid-flush and its services log
    their cancellation as tracebacks, which ended a clean SIGTERM stop in 60 lines of
    SQLAlchemy (found by CI: tests/chaos SIGTERM mid-run).
    """
    if os.environ.get("PREFECT_API_URL"):
        return
    import subprocess
    import types

    from prefect.server.api import server as api_server

    from flows.deathwatch import wrap

    current = getattr(api_server, "subprocess", None)
    if current is None or getattr(current, "sandflow_detached", False):
        return

    def popen(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        if "stdout" in kwargs or "stderr" in kwargs:
            return subprocess.Popen(wrap(list(args)), start_new_session=True, **kwargs)  # type: ignore[call-overload]
        with _server_log() as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(  # type: ignore[call-overload]
                wrap(list(args)),
                start_new_session=True,
                stdout=log,
                stderr=subprocess.STDOUT,
                **kwargs,
            )

    shim = types.SimpleNamespace(
        **{k: getattr(subprocess, k) for k in dir(subprocess) if not k.startswith("__")}
    )
    shim.Popen = popen
    shim.sandflow_detached = True
    api_server.subprocess = shim  # type: ignore[assignment]


SERVER_LOG_MAX_BYTES = 10 * 1024 * 1024


def server_log_path() -> Path:
    """Where the ephemeral server's output goes: PREFECT_HOME/sandflow-ephemeral-server.log."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / "sandflow-ephemeral-server.log"


def _server_log() -> BinaryIO:
    """The log file, opened for appending (started afresh once it passes 10 MB)."""
    path = server_log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        too_big = path.stat().st_size > SERVER_LOG_MAX_BYTES
    except FileNotFoundError:
        too_big = False
    f = open(path, "wb" if too_big else "ab")  # noqa: SIM115 (closed by the caller's with)
    f.write(f"--- ephemeral Prefect server for pid {os.getpid()}\n".encode())
    f.flush()
    return f


def prefect_already_imported() -> bool:
    import sys

    return "prefect" in sys.modules
