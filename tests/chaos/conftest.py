"""Helpers of the chaos suite: real runs in real subprocesses, faults from outside.

The suite reuses the shared fixtures (tests/conftest.py: docker_engine, sandbox_image,
sandbox_rootfs, prefect_harness, test_run_id) and the pipeline tests' tiny task set and
solver (tests/flows/conftest.py); what it adds is the ability to start a *real*
`sandflow flows run` process, hurt it, and look at what it left behind: the warehouse
through DuckDB, the engine through labels, the process table through /proc.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_RUN_PREFIX
from tests.flows.conftest import solver
from tests.scripted_model import Reply, ScriptedModel

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SANDFLOW = str(BIN / "sandflow")


def chaos_run_id(tag: str) -> str:
    return f"{TEST_RUN_PREFIX}chaos-{tag}-{uuid.uuid4().hex[:6]}"


def slow_solver(delay_s: float) -> Callable[[dict, int], Reply]:
    """The pipeline tests' solver (4 turns: look, compute, view, submit), with think time."""

    def answer(body: dict, index: int) -> Reply:
        return dataclasses.replace(solver(body, index), delay_s=delay_s)

    return answer


@pytest.fixture
def slow_model() -> Iterator[ScriptedModel]:
    """A scripted model that solves every task in 4 turns, 0.3 s per reply."""
    with ScriptedModel(default=slow_solver(0.3), models=("scripted",)) as server:
        yield server


def containers_of(run_id: str, *, running_only: bool = False) -> list[Any]:
    """Docker containers labelled with this run id (the only way sandflow finds its own)."""
    from sandbox.engine import docker_client

    found = docker_client().containers.list(ignore_removed=True, all=True, filters={"label": f"sandflow.run_id={run_id}"})
    return [c for c in found if c.status == "running"] if running_only else found


def bwrap_sandboxes_of(run_id: str) -> list[Any]:
    from sandbox import gc as G

    return [i for i in G.bwrap_sandboxes(run_id) if i.run_id == run_id]


def query(warehouse: Path, sql: str, run_id: str | None = None) -> list[tuple[Any, ...]]:
    """DuckDB over the warehouse's Parquet files (a fresh connection: sees every commit)."""
    from warehouse.query import connect

    with connect(warehouse, run_id=run_id) as q:
        return q.rows(sql)


@pytest.fixture(scope="session")
def cli_prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One PREFECT_HOME for every `sandflow` subprocess of the session (migrations once)."""
    return tmp_path_factory.mktemp("chaos-prefect-home")


def cli_env(prefect_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a `sandflow` subprocess: ephemeral Prefect, no user config or keys."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(prefect_home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        PREFECT_LOGGING_LEVEL="WARNING",
        COLUMNS="200",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@dataclasses.dataclass
class CliRun:
    """A `sandflow ...` process started in its own session (process group)."""

    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise AssertionError(f"`sandflow` did not end within {timeout}s:\n{self.output[-3000:]}") from None

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the process group (e.g. Prefect's ephemeral server)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@pytest.fixture
def start_cli(tmp_path: Path, cli_prefect_home: Path) -> Iterator[Callable[..., CliRun]]:
    """Start `sandflow <args>` in its own process group; every group is killed at teardown."""
    started: list[CliRun] = []

    def start(*args: str, env: dict[str, str] | None = None) -> CliRun:
        log_path = tmp_path / f"cli-{len(started)}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [SANDFLOW, *args],
            cwd=tmp_path,
            env=env or cli_env(cli_prefect_home),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        run = CliRun(proc, log_path)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill_group()
    _kill_orphaned_servers(cli_prefect_home)


def _kill_orphaned_servers(prefect_home: Path) -> None:
    """Prefect's ephemeral API server runs in its own session (flows/prefect_env.py): after a
    kill -9 of its flow process it is orphaned. Remove ours (same PREFECT_HOME, parent gone)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == "1" and f"PREFECT_HOME={prefect_home}".encode() in env:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def gc_run(run_id: str) -> None:
    """Remove what a dead run left behind, by label, as a user would (`sandflow sandbox gc`)."""
    from sandbox import gc as G
    from sandbox.engine import docker_client

    G.collect(docker_client(), run_prefix=run_id)
