"""A temporary Prefect API server for Dask (and Ray) runs in ephemeral mode.

Without PREFECT_API_URL, Prefect runs "ephemeral": each *process* that needs the API
starts its own server on 127.0.0.1. With the thread runner that is one server for the
run; with Dask every worker process starts another one (over the same SQLite file),
and under load their task runs fail ("Server process did not start", "Failed to reach
API": docs/reliability.md). So for `--task-runner dask` without an API URL sandflow
starts ONE real `prefect server start` on 127.0.0.1 (a free port) for the run's
duration, points the flow and the local cluster's workers at it, and stops it at the
end: on success, on errors, on Ctrl+C/SIGTERM (the CLI turns both into
KeyboardInterrupt), and on kill -9 of the CLI (it runs under flows/deathwatch.py, which
stops it as soon as the CLI process is gone). Workers on other hosts (an external --dask-address) cannot use
a server on this host's loopback: that case fails at once, asking for PREFECT_API_URL.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from engine.plan import RunConfigError
from flows.deathwatch import wrap

STOP_TIMEOUT_S = 20.0


def configured_api_url() -> str | None:
    """The Prefect API the user configured (environment or profile), if any."""
    from prefect.settings import PREFECT_API_URL

    return os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value() or None


def _local_address(address: str) -> bool:
    host = urlparse(address if "://" in address else f"tcp://{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def api_for_task_runner(task_runner: str, dask_address: str | None = None) -> Iterator[str | None]:
    """Around a run: a shared Prefect API when Dask would otherwise go ephemeral.

    Yields the temporary server's API URL, or None when nothing was needed (thread
    runner, or PREFECT_API_URL already set). Ray's worker processes are like Dask's.
    """
    if task_runner not in ("dask", "ray") or configured_api_url():
        yield None
        return
    if task_runner == "dask" and dask_address and not _local_address(dask_address):
        raise RunConfigError(
            f"--task-runner dask --dask-address {dask_address}: no Prefect API is configured "
            "(PREFECT_API_URL is unset), and Dask workers on other hosts cannot reach a server on "
            "this host's 127.0.0.1. Start a Prefect server the workers can reach (`prefect server "
            "start --host <this host's address>`) and set PREFECT_API_URL=http://<host>:4200/api "
            "here and on the workers."
        )
    with temporary_server() as url, pointed_at(url):
        yield url


@contextlib.contextmanager
def pointed_at(api_url: str) -> Iterator[None]:
    """This process (settings context) and processes it starts (environment) use `api_url`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api_url  # inherited by the LocalCluster's worker processes
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            yield
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _startup_timeout() -> float:
    try:
        return max(30.0, float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")))
    except ValueError:
        return 90.0


def _server_env() -> dict[str, str]:
    """The user's Prefect settings (home, batch sizes from flows/prefect_env.py), minus the
    parts a throwaway server must not do: UI, analytics, scheduling the user's deployments."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_SERVER_UI_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
        PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED="false",
        PREFECT_SERVER_SERVICES_FOREMAN_ENABLED="false",
        DO_NOT_TRACK="1",
    )
    return env


@contextlib.contextmanager
def temporary_server(timeout_s: float | None = None) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 and a free port, for the block; yields its API URL."""
    import httpx

    timeout_s = timeout_s or _startup_timeout()
    port = _free_port()
    prefect_bin = Path(sys.executable).parent / "prefect"
    argv = [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    argv = wrap(argv)  # the server dies with us, even after kill -9 (flows/deathwatch.py)
    log = tempfile.NamedTemporaryFile(prefix="sandflow-prefect-server-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        argv,
        env=_server_env(),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl+C in the terminal must not stop it before the run has ended
    )
    api = f"http://127.0.0.1:{port}/api"
    failed = False
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                failed = True  # keep its log: the error names it
                tail = Path(log.name).read_text(errors="replace")[-1500:]
                raise RunConfigError(
                    f"the temporary Prefect server for the Dask or Ray run did not start on 127.0.0.1:{port} "
                    f"within {timeout_s:.0f} s (exit status {proc.poll()}; log {log.name}): {tail}\n"
                    "Start one yourself (`prefect server start`) and set PREFECT_API_URL."
                )
            time.sleep(0.3)
        yield api
    finally:
        _stop(proc)
        log.close()
        if not failed:
            Path(log.name).unlink(missing_ok=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
