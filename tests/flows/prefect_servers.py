"""A real `prefect server start` on 127.0.0.1 for tests, and the two ways tests talk to it
(the `prefect` CLI and the REST API). Used by test_scale.py (SQLite) and
test_prefect_server.py (PostgreSQL)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without its Prefect settings, with its own PREFECT_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_LOGGING_LEVEL="WARNING",
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def stopped_at_exit(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """A process started in its own session: its whole group is stopped when the block ends."""
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@contextlib.contextmanager
def prefect_server(workdir: Path, **server_env: str) -> Iterator[dict[str, str]]:
    """`prefect server start --host 127.0.0.1` on a free port, its own PREFECT_HOME under
    `workdir` and `server_env` (e.g. PREFECT_API_DATABASE_CONNECTION_URL); yields the
    environment of a client of it (PREFECT_API_URL set). Its output: workdir/server.log."""
    import httpx

    port = free_port()
    env = client_env(workdir / "prefect-home", **server_env)
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api"
    with stopped_at_exit(proc):
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prefect server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        client = {k: v for k, v in env.items() if k != "PREFECT_API_DATABASE_CONNECTION_URL"}
        yield dict(client, PREFECT_API_URL=api)


def prefect(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The `prefect` CLI of this environment, run from the repo (where prefect.yaml is)."""
    return subprocess.run(
        [str(BIN / "prefect"), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def api(env: dict[str, str], path: str, body: dict[str, Any] | None = None) -> Any:
    """GET (no body) or POST (a body) on the server's REST API; the decoded JSON."""
    import httpx

    url = env["PREFECT_API_URL"] + path
    r = httpx.post(url, json=body, timeout=30) if body is not None else httpx.get(url, timeout=30)
    r.raise_for_status()
    return r.json()
