"""A stalled engine: every engine call the docker backend makes is bounded.

A real HTTP server on a unix socket plays an engine that answers the handshake (version,
ping, image lookup) and then never answers a container call, as dockerd did under
16-way load. Opening a sandbox against it must fail with a SandboxError naming the
bound, not hang the episode; a result that arrives late is cleaned up.
"""

from __future__ import annotations

import json
import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from sandbox import SandboxConfig, SandboxError, SandboxLimits, open_sandbox
from sandbox.deadline import ENV_TIMEOUT, EngineTimeout, bounded


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
def stalled_engine(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "engine.sock"
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
    stalled_engine: str, monkeypatch: pytest.MonkeyPatch, network: str
) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, "1")
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


def test_a_bad_bound_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, "soon")
    with pytest.raises(SandboxError, match=f"{ENV_TIMEOUT}='soon' is not a number"):
        bounded("inspect", lambda: 1)
