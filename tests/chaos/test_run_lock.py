"""One run id, one writer; and nothing of a kill -9'd run keeps running.

Real `sandflow flows run` processes (each with Prefect's ephemeral API server), the
scripted model over HTTP, the warehouse on disk:

- a second process on a running run id is refused, naming the run and the holder (pid,
  host, start time), through the CLI and through the Python API; with --wait it starts
  when the first ends, and then finds nothing left to do. Every episode ran once.
- kill -9 of a run: its lock is free at once (a kernel flock), readers show the run
  interrupted (not `running` forever), the same run id resumes right away, and Prefect's
  ephemeral server it started is gone within seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos.conftest import CliRun, chaos_run_id, query, wait_for
from tests.flows.conftest import solver, tiny_tasks, write_tasks
from tests.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.chaos

N_TASKS = 4


def _args(ts: Path, wh: Path, rid: str, model: ScriptedModel, *extra: str) -> list[str]:
    return [
        "flows", "run", str(ts), "--base-url", model.url, "--model", "scripted",
        "--mode", "llm", "--concurrency", "1", "--wall-clock", "600",
        "--warehouse", str(wh), "--run-id", rid, "--no-compact", *extra,
    ]  # fmt: skip


def _gated(gate: threading.Event) -> Callable[[dict, int], Reply]:
    """The solver, answering only once the test opens the gate (keeps a run in flight)."""

    def answer(body: dict, index: int) -> Reply:
        gate.wait(300)  # under the wall clock: a held reply is never a timeout, even at load
        return solver(body, index)

    return answer


def _holder_pid(wh: Path, rid: str) -> int | None:
    from warehouse.layout import Layout
    from warehouse.runlock import LOCK_NAME, read_holder

    path = Layout(wh).journal_dir(rid) / LOCK_NAME
    if not path.exists():
        return None
    h = read_holder(path)
    return h.pid if h else None


def _servers_of(prefect_home: Path) -> list[int]:
    """Live Prefect API server processes (and their watchdogs) started with this PREFECT_HOME."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or f"PREFECT_HOME={prefect_home}".encode() not in env.split(b"\0"):
            continue
        if b"uvicorn" in cmd or b"flows.deathwatch" in cmd:
            found.append(int(pid))
    return found


def test_second_process_on_a_run_id_is_refused_or_waits(
    tmp_path: Path, start_cli, prefect_harness: None
) -> None:
    from engine import RunLockedError
    from flows.run import run_flow
    from tests.flows.conftest import run_kwargs

    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(N_TASKS))
    wh = tmp_path / "wh"
    rid = chaos_run_id("lock")
    gate = threading.Event()
    with ScriptedModel(default=_gated(gate), models=("scripted",)) as model:
        first: CliRun = start_cli(*_args(ts, wh, rid, model))
        wait_for(
            lambda: _holder_pid(wh, rid) == first.proc.pid, 120, "the first run to hold its lock"
        )
        wait_for(
            lambda: len(model.requests) >= 1 or first.proc.poll() is not None, 60, "a model call"
        )
        assert first.proc.poll() is None, first.output[-3000:]

        # the CLI: refused at once, naming the run and the holder
        second = start_cli(*_args(ts, wh, rid, model))
        assert second.wait(timeout=60) == 1, second.output[-3000:]
        out = " ".join(second.output.split())
        assert rid in out and f"pid {first.proc.pid}" in out and socket.gethostname() in out, out
        assert "started" in out and "--wait" in out and "Traceback" not in out, out

        # the Python API: the same refusal, as an exception naming the holder
        with pytest.raises(RunLockedError, match=f"pid {first.proc.pid}"):
            run_flow(**run_kwargs(ts, model, wh, mode="llm", run_id=rid, concurrency=1))

        # --wait: starts once the first is done, and has nothing left to do
        third = start_cli(*_args(ts, wh, rid, model, "--wait"))
        wait_for(lambda: "waiting" in third.output or third.proc.poll() is not None, 120, "--wait")
        gate.set()
        assert first.wait(timeout=180) == 0, first.output[-3000:]
        assert third.wait(timeout=180) == 0, third.output[-3000:]
        assert "waiting" in third.output, third.output[-3000:]
        assert f"0 recorded, 0 failed, {N_TASKS} skipped" in " ".join(third.output.split())
        assert len(model.requests) == N_TASKS, "an episode ran twice"
    rows = query(
        wh, f"SELECT count(*), count(DISTINCT episode_id) FROM _raw_episodes WHERE run_id = '{rid}'"
    )
    assert rows == [(N_TASKS, N_TASKS)], rows


def test_kill9_frees_the_run_and_its_prefect_server(
    tmp_path: Path, start_cli, cli_prefect_home: Path
) -> None:
    ts = write_tasks(tmp_path / "tiny.parquet", tiny_tasks(N_TASKS))
    wh = tmp_path / "wh"
    rid = chaos_run_id("lock-kill9")
    gate = threading.Event()
    with ScriptedModel(default=_gated(gate), models=("scripted",)) as model:
        run: CliRun = start_cli(*_args(ts, wh, rid, model))
        wait_for(lambda: _holder_pid(wh, rid) == run.proc.pid, 120, "the run to hold its lock")
        wait_for(
            lambda: len(model.requests) >= 1 or run.proc.poll() is not None, 60, "a model call"
        )
        assert run.proc.poll() is None, run.output[-3000:]
        servers = _servers_of(cli_prefect_home)
        assert servers, "no Prefect API server found for the run: the test could not fail"

        os.kill(run.proc.pid, signal.SIGKILL)  # the run's process only, as the OOM killer does
        run.proc.wait(timeout=30)
        # its record still says running; readers see the free lock and say interrupted
        assert query(wh, f"SELECT status, abandoned FROM runs WHERE run_id = '{rid}'") == [
            ("interrupted", True)
        ]
        wait_for(
            lambda: not _servers_of(cli_prefect_home), 30, "the killed run's Prefect server to exit"
        )

        gate.set()
        resumed = start_cli(*_args(ts, wh, rid, model))  # no --wait: the lock must be free
        assert resumed.wait(timeout=240) == 0, resumed.output[-3000:]
        assert "0 failed" in resumed.output, resumed.output[-3000:]
    rows = query(
        wh, f"SELECT count(*), count(DISTINCT episode_id) FROM episodes WHERE run_id = '{rid}'"
    )
    assert rows == [(N_TASKS, N_TASKS)], rows
    wait_for(
        lambda: not _servers_of(cli_prefect_home), 30, "the resumed run's Prefect server to exit"
    )


@pytest.mark.parametrize("command", ["bench", "flows run"])
def test_both_commands_refuse_a_held_run_before_starting_anything(
    tmp_path: Path, command: str
) -> None:
    """The CLI checks the lock before Prefect or a model server starts (one sentence, exit 1)."""
    from typer.testing import CliRunner

    from sandflow.cli import app
    from warehouse.layout import Layout
    from warehouse.runlock import RunLock

    wh = tmp_path / "wh"
    rid = chaos_run_id("lock-cli")
    held = RunLock(Layout(wh), rid)
    held.acquire()
    try:
        args = [*command.split(), *(["--suite", "smoke"] if command == "bench" else ["smoke"])]
        res = CliRunner().invoke(
            app,
            [*args, "--run-id", rid, "--warehouse", str(wh), "--base-url", "http://127.0.0.1:9/v1"],
            env={"COLUMNS": "300"},
        )
    finally:
        held.release()
    assert res.exit_code == 1, res.output
    out = " ".join(res.output.split())
    assert f"run {rid} is being run by pid {os.getpid()}" in out and "Traceback" not in out, out
