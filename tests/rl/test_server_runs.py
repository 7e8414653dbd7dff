"""Issue #22 item 5: the rollout server's runs end, and its sandboxes carry their run.

- A trainer that disconnects: its batch's warehouse run leaves `running` (interrupted),
  every time, and so does a batch still streaming when the server stops.
- A server killed with kill -9 mid-batch: the batch held its run's lock, so the run
  reads `interrupted` (abandoned), and the same step runs again at once.
- A warm pool lives across batches: the sandboxes it creates for a later batch are
  labelled with that batch's run id, so `sandflow sandbox gc --run-id` finds them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rl.client import RolloutClient
from tests.chaos.conftest import wait_for
from tests.rl.conftest import containers_of, new_run_id, rollout_server, status_of
from tests.rl.test_server import answering, request
from tests.scripted_model import ScriptedModel

REPO = Path(__file__).resolve().parents[2]


def stream_until_sleeping(server: str, model: ScriptedModel, run_id: str, n: int) -> None:
    """POST a batch, wait until its n episodes sit in their command, then hang up."""
    before = len(model.requests)
    with httpx.Client(timeout=240) as http, http.stream("POST", f"{server}/v1/rollouts", json=request(model, run_id, n=n)) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the connection
        assert '"type":"start"' in next(lines)
        assert model.wait_for_requests(before + n, timeout=240)


def test_every_disconnect_leaves_the_batch_run_interrupted(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    with ScriptedModel(default=answering(itertools.repeat("42"), command="sleep 60; ")) as model, rollout_server(wh) as (url, _):
        runs = [new_run_id(f"srv-gone{i}") for i in range(3)]
        for rid in runs:
            stream_until_sleeping(url, model, rid, n=2)
            assert status_of(wh, rid) == "interrupted", rid
            deadline = time.monotonic() + 30
            while containers_of(rid) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert containers_of(rid) == []
        with RolloutClient(url) as client:
            assert client.health()["active_batches"] == 0


def test_a_batch_streaming_when_the_server_stops_is_interrupted(tmp_path: Path) -> None:
    wh, rid = tmp_path / "wh", new_run_id("srv-stop")
    with ScriptedModel(default=answering(itertools.repeat("42"), command="sleep 60; ")) as model:
        with rollout_server(wh, graceful_s=1.0) as (url, srv):
            got_start = threading.Event()

            def trainer() -> None:
                try:
                    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/rollouts", json=request(model, rid, n=2)) as resp:
                        for _line in resp.iter_lines():
                            got_start.set()
                except httpx.HTTPError:
                    pass

            t = threading.Thread(target=trainer, daemon=True)
            t.start()
            assert got_start.wait(240) and model.wait_for_requests(2, timeout=240)
            srv.should_exit = True  # as Ctrl+C does; the open stream is cut after 1 s
        t.join(60)
        assert status_of(wh, rid, within_s=5) == "interrupted"
    assert containers_of(rid) == []


def test_pooled_sandboxes_created_for_a_later_batch_carry_its_run_id(tmp_path: Path) -> None:
    """Batch A warms the server's pool with one sandbox; batch B needs three at once:
    one is A's (reset, reused), the two created for B are labelled B."""
    wh = tmp_path / "wh"
    a, b = new_run_id("srv-pool-a"), new_run_id("srv-pool-b")
    with ScriptedModel(default=answering(itertools.repeat("42"))) as model, rollout_server(wh, reuse="pool") as (url, _):
        with RolloutClient(url) as client:
            assert client.rollouts(request(model, a, n=1)).summary["ok"] == 1
        model.default = answering(itertools.repeat("42"), command="sleep 60; ")
        labelled_b: list[Any] = []
        with httpx.Client(timeout=240) as http, http.stream("POST", f"{url}/v1/rollouts", json=request(model, b, n=3)) as resp:
            lines = resp.iter_lines()
            assert '"type":"start"' in next(lines)
            assert model.wait_for_requests(2 + 3, timeout=240)  # A's two turns, then B's three first
            labelled_b = containers_of(b)
        assert len(labelled_b) >= 2, [c.labels.get("sandflow.run_id") for c in containers_of(a) + labelled_b]
        from sandbox import gc as G
        from sandbox.engine import docker_client

        found = [i for i in G.docker_sandboxes(docker_client(), run_prefix=b) if i.run_id == b]
        assert len(found) >= 2  # what `sandflow sandbox gc --run-id B` looks at


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_process(wh: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real `sandflow rl serve` process (its own session) with this worktree's code;
    killed (its group) and its run's sandboxes left to the caller at the end."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SANDFLOW_SANDBOX_REUSE": "fresh",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "sandflow"), "rl", "serve", "--port", str(port),
             "--warehouse", str(wh), "--max-concurrency", "2", "--max-steps", "6",
             "--no-compact"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
        return False

    try:
        wait_for(answers, 120, "`sandflow rl serve` to answer", poll=0.2)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _held(gate: threading.Event) -> Any:
    """The scripted policy, holding every reply until the test opens the gate."""
    answer = answering(itertools.repeat("42"))

    def reply(body: dict, index: int) -> Any:
        gate.wait(300)
        return answer(body, index)

    return reply


@pytest.mark.slow  # a server process, a kill -9, then the same step again (~15 s)
@pytest.mark.usefixtures("sandbox_image")
def test_a_batch_of_a_killed_server_reads_interrupted_and_resumes(tmp_path: Path) -> None:
    """kill -9 of `sandflow rl serve` mid-batch: the batch held its run's lock (as a
    `sandflow flows run` does), so readers see the run interrupted and abandoned, not
    `running` forever; the same step sent again to a new server runs at once."""
    from engine import RunLockedError
    from engine.run import hold_run
    from warehouse import Warehouse
    from warehouse.query import connect

    wh, rid = tmp_path / "wh", new_run_id("srv-kill9")
    gate = threading.Event()
    try:
        with ScriptedModel(default=_held(gate), models=("scripted",)) as model:
            with serve_process(wh, tmp_path / "serve.log") as (url, proc):
                http = httpx.Client(timeout=240)
                with http.stream("POST", f"{url}/v1/rollouts", json=request(model, rid, n=2)) as resp:
                    lines = resp.iter_lines()
                    assert '"type":"start"' in next(lines)
                    assert model.wait_for_requests(2, timeout=240)  # both replies held
                    assert Warehouse(wh).run_info(rid)["status"] == "running"
                    # the server holds the run: another writer is refused, naming it
                    with pytest.raises(RunLockedError, match=f"pid {proc.pid}"), hold_run(Warehouse(wh), rid):
                        pass
                    os.kill(proc.pid, signal.SIGKILL)  # the server only, as the OOM killer does
                    proc.wait(timeout=30)
                http.close()
            with connect(wh) as q:
                rows = q.rows(f"SELECT status, abandoned FROM runs WHERE run_id = '{rid}'")
            assert rows == [("interrupted", True)]
            assert Warehouse(wh).run_info(rid)["status"] == "interrupted"

            gate.set()  # the same step again, on a new server: the lock is free
            with rollout_server(wh) as (url2, _), RolloutClient(url2) as client:
                result = client.rollouts(request(model, rid, n=2))
            assert result.summary["ok"] == 2, result.summary
            assert status_of(wh, rid) == "finished"
    finally:
        from sandbox import gc as G
        from sandbox.engine import docker_client

        G.collect(docker_client(), run_prefix=rid)  # what the killed server left


def test_a_batch_whose_run_another_process_writes_is_refused_naming_it(tmp_path: Path) -> None:
    """One run id, one writer: a batch on a run id whose lock is held elsewhere (here: this
    test process, as a `flows run` would) is refused with 409 naming the holder, before
    anything is recorded or run."""
    from rl.client import RolloutServerError
    from warehouse.layout import Layout
    from warehouse.runlock import RunLock

    wh, rid = tmp_path / "wh", new_run_id("srv-locked")
    held = RunLock(Layout(wh), rid)
    held.acquire()
    try:
        with ScriptedModel(default=answering(itertools.repeat("42"))) as model, rollout_server(wh) as (url, _):
            with pytest.raises(RolloutServerError) as err, RolloutClient(url) as client:
                client.rollouts(request(model, rid, n=1))
            assert model.requests == []
    finally:
        held.release()
    msg = str(err.value)
    assert "(409)" in msg and f"run {rid} is being run by pid {os.getpid()}" in msg, msg
    from warehouse import Warehouse

    assert Warehouse(wh).run_info(rid) is None and containers_of(rid) == []
