"""A stalled engine: every engine call the docker backend makes is bounded.

A real HTTP server on a unix socket plays an engine that answers the handshake (version,
ping, image lookup) and then never answers a container call, as dockerd did under
16-way load. Opening a sandbox against it must fail with a SandboxError naming the
bound, not hang the episode; a result that arrives late is cleaned up.
"""

from __future__ import annotations

import json
import socketserver
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from sandbox import SandboxConfig, SandboxError, SandboxLimits, open_sandbox
from sandbox.deadline import EngineTimeout, bounded
from sandbox.settings import HostSettings

ENV_TIMEOUT = "SANDFLOW_ENGINE_CALL_TIMEOUT_S"  # how the user sets the bound (sandflow/host.py)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _StalledEngine(BaseHTTPRequestHandler):
    release = threading.Event()
    stalled: list[str] = []

    def address_string(self) -> str:  # unix sockets have no peer address
        return "unix"

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.endswith("/_ping"):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"OK")
        elif self.path.endswith("/version"):
            self._json({"ApiVersion": "1.41", "Version": "20.10.0"})
        elif "/images/" in self.path:
            self._json({"Id": "sha256:stalled", "Size": 1})
        else:
            self._stall()

    def do_POST(self) -> None:  # noqa: N802
        self._stall()

    def do_DELETE(self) -> None:  # noqa: N802
        self._stall()

    def _stall(self) -> None:
        self.stalled.append(f"{self.command} {self.path.split('?')[0]}")
        self.release.wait(60)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def stalled_engine(short_tmp: Path) -> Iterator[str]:
    # a unix socket's path holds 107 bytes: tmp_path can be past it (tests/conftest.py)
    path = Path(tempfile.mkdtemp(dir=short_tmp)) / "engine.sock"
    _StalledEngine.release.clear()
    _StalledEngine.stalled.clear()
    server = _Server(str(path), _StalledEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"unix://{path}"
    _StalledEngine.release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("network", ["none", "host"])
def test_a_stalled_engine_call_becomes_a_sandbox_error(
    stalled_engine: str, host_settings: Any, network: str
) -> None:
    host_settings(engine_call_timeout_s=1)
    config = SandboxConfig(
        run_id="pytest-stall",
        image="sandflow/stalled:latest",
        docker_host=stalled_engine,
        limits=SandboxLimits(network=network),  # type: ignore[arg-type]
    )
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match=f"did not answer create_container within 1s.*{ENV_TIMEOUT}"):
        open_sandbox(config)
    assert time.monotonic() - t0 < 30
    assert _StalledEngine.stalled and _StalledEngine.stalled[0].endswith("/containers/create")


def test_a_late_result_is_cleaned_up() -> None:
    answer = threading.Event()
    cleaned: list[str] = []
    with pytest.raises(EngineTimeout, match="within 0s"):
        bounded("create_container", lambda: answer.wait(10) and "c1", timeout=0.2, late=cleaned.append)
    answer.set()
    deadline = time.monotonic() + 10
    while not cleaned and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cleaned == ["c1"]


def test_errors_and_results_pass_through() -> None:
    assert bounded("inspect", lambda: 42, timeout=5) == 42
    with pytest.raises(KeyError):
        bounded("inspect", lambda: {}["x"], timeout=5)


def test_a_bad_bound_is_named(tmp_path: Path) -> None:
    """The application reads the bound and names it; the library refuses a bound <= 0."""
    import os
    import subprocess
    import sys

    env = {**os.environ, ENV_TIMEOUT: "soon"}
    proc = subprocess.run(
        [sys.executable, "-m", "sandflow.cli", "sandbox", "gc", "--run-id", "pytest-none"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid setting engine_call_timeout_s (SANDFLOW_ENGINE_CALL_TIMEOUT_S" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match="engine_call_timeout_s=0 must be > 0"):
        HostSettings(engine_call_timeout_s=0)


def test_engine_calls_wait_their_turn_and_are_bounded_from_when_they_are_sent(host_settings: Any) -> None:
    """Issue #22.6: at most `engine_calls_in_flight` calls go to the engine at once. A call
    that waits for its turn longer than the bound, while calls ahead of it keep finishing,
    is not a hung engine: it runs (it once failed as one)."""
    host_settings(engine_calls_in_flight=1, engine_call_timeout_s=3)
    gates = [threading.Event() for _ in range(3)]
    running: list[int] = []
    most = [0]
    lock = threading.Lock()
    results: dict[int, object] = {}

    def call(i: int) -> int:
        with lock:
            running.append(i)
            most[0] = max(most[0], len(running))
        gates[i].wait(30)
        with lock:
            running.remove(i)
        return i

    def caller(i: int) -> None:
        try:
            results[i] = bounded(f"start-{i}", lambda: call(i))
        except Exception as e:  # noqa: BLE001 - the assertion says which
            results[i] = e

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # in order: 0 runs, 1 and 2 wait
    time.sleep(2.0)
    gates[0].set()  # progress at ~2 s
    time.sleep(2.0)
    gates[1].set()
    gates[2].set()  # the last one waited ~4 s, over the 3 s bound, with progress within it
    for t in threads:
        t.join(30)
    assert results == {0: 0, 1: 1, 2: 2}
    assert most[0] == 1


def test_a_queue_behind_calls_that_never_finish_ends_in_engine_timeout(host_settings: Any) -> None:
    """The engine finishes nothing: a caller that cannot even send its call gives up after
    the bound, naming the calls in flight (a stuck engine gathers no unbounded threads)."""
    host_settings(engine_calls_in_flight=1, engine_call_timeout_s=1)
    stuck = threading.Event()
    with pytest.raises(EngineTimeout, match="within 1s"):
        bounded("create_container", lambda: stuck.wait(30))
    try:
        with pytest.raises(EngineTimeout, match=r"finished none of its 1 calls in flight within 1s, so start was not sent"):
            bounded("start", lambda: 1)
    finally:
        stuck.set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the stuck call returned: its slot is free again
        try:
            assert bounded("inspect", lambda: 7) == 7
            break
        except EngineTimeout:
            time.sleep(0.1)
    else:
        raise AssertionError("the slot of the call that returned was never freed")
