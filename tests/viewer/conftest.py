"""Fixtures of the viewer tests: a warehouse of real records, the real server on
127.0.0.1 (uvicorn in a thread, port 0), and headless Debian Chromium driven by Playwright.

Screenshots go to the test's tmp dir and are copied to <repo>/test-artifacts/viewer/
(gitignored), so a run leaves them to look at.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.warehouse.factory import T0, make_episode, record

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "viewer"
RUN_A = "pytest-view-a"
RUN_B = "pytest-view-b"
HOSTILE = (
    "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\">"
    "<b>bold?</b> &amp; </pre></details><a href=\"javascript:window.__pwned=3\">x</a>"
)
FAKE_KEY = "sk-viewertest0123456789abcdefXYZ"  # shaped like an OpenAI key: must be masked
# Recorded as plain text (no key was set then); exported as SANDFLOW_API_KEY while viewing,
# so only the viewer's own masking can hide it.
LATE_SECRET = "late-secret-value-7f3a9"


@dataclass
class ViewerServer:
    url: str
    lw: Any
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.lw.close()


def start_viewer(root: Path, *, refresh_s: float = 0.3) -> ViewerServer:
    """The real app on a free port of 127.0.0.1, serving in a thread."""
    import uvicorn

    from sandflow.viewer.app import create_app
    from sandflow.viewer.store import LiveWarehouse

    lw = LiveWarehouse(root, refresh_s=refresh_s, sql_timeout_s=5)
    lw.open()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(lw), log_level="warning", access_log=False, lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the viewer did not start"
    return ViewerServer(f"http://127.0.0.1:{port}", lw, server, thread)


def _call(i: int, cmd: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "name": "execute_bash", "arguments": json.dumps({"command": cmd})}


def build_warehouse(root: Path) -> dict[str, Any]:
    """Two runs over the same tasks (both modes), scored and labelled; one hostile episode;
    one with a long output, invalid JSON arguments and an editor call."""
    from tasks.records import Observation, ToolCall
    from warehouse import Warehouse

    wh = Warehouse(root)
    w = wh.writer(durability="flush")
    eps: dict[str, Any] = {}
    for run in (RUN_A, RUN_B):
        wh.write_run(run, model=f"model-{run[-1]}", dataset="tiny", config={"temperature": 0.7})
        for i, domain in enumerate(("math", "math", "chemistry")):
            for mode in ("sandbox", "llm"):
                task = f"task-{i}"
                ep, turns = make_episode(
                    run, task, mode=mode, domain=domain, turns=3 if mode == "sandbox" else 1,
                    answer=f"{42 + i}" if (i + (run == RUN_B)) % 2 == 0 else "7",
                    termination="submitted" if i != 2 or mode == "llm" else "max_steps",
                )  # fmt: skip
                if mode == "llm":
                    turns = [t.model_copy(update={"tool_calls": [], "observations": []}) for t in turns]
                eps[(run, task, mode)] = ep
                record(w, ep, turns)
    # a hostile episode: everything the model wrote tries to become markup or script
    hostile, turns = make_episode(RUN_A, "task-hostile", domain="math", turns=2, answer=HOSTILE)
    turns[0] = turns[0].model_copy(
        update={
            "assistant_content": f"Here is my plan {HOSTILE} and my key {FAKE_KEY} and {LATE_SECRET}",
            "reasoning_content": f"thinking {HOSTILE}",
            "tool_calls": [ToolCall(id="call_0", name="execute_bash", arguments=json.dumps({"command": f"echo '{HOSTILE}'"}))],
            "observations": [Observation(tool_call_id="call_0", name="execute_bash", content=f"{HOSTILE}\n" * 3, exit_code=0)],
        }
    )  # fmt: skip
    long_out = "".join(f"line {n}: {'x' * 40}\n" for n in range(400))
    turns[1] = turns[1].model_copy(
        update={
            "assistant_content": "Let me look at the data and fix the file.",
            "tool_calls": [
                ToolCall(id="call_a", name="execute_bash", arguments=json.dumps({"command": "seq 400"})),
                ToolCall(id="call_b", name="str_replace_editor", arguments=json.dumps(
                    {"command": "str_replace", "path": "/testbed/output/answer.txt", "old_str": "41", "new_str": "42"})),
                ToolCall(id="call_c", name="execute_bash", arguments='{"command": "ls'),  # invalid JSON
            ],
            "observations": [
                Observation(tool_call_id="call_a", name="execute_bash", content=long_out, exit_code=0, duration_s=0.2),
                Observation(tool_call_id="call_b", name="str_replace_editor", content="The file was edited.", exit_code=0),
                Observation(tool_call_id="call_c", name="execute_bash", content="", error="invalid JSON arguments"),
            ],
        }
    )  # fmt: skip
    eps["hostile"] = hostile
    record(w, hostile, turns)
    w.close()
    for run in (RUN_A, RUN_B):
        rows: list[dict[str, Any]] = []
        usage: list[dict[str, Any]] = []
        for ep in eps.values():
            if ep.run_id != run:
                continue
            right = ep.answer == str(42 + int(ep.task_id.split("-")[1])) if ep.task_id != "task-hostile" else False
            rows.append({
                "run_id": run, "episode_id": ep.episode_id, "verifier": "exact",
                "score": 1.0 if right else 0.0, "passed": right,
                "reason": "matches the ground truth" if right else f"expected {ep.task_id} answer",
                "answer": ep.answer, "ground_truth": "42",
            })  # fmt: skip
            if ep.mode == "sandbox":
                for t in range(ep.num_turns):
                    cap = "computation" if ep.task_id != "task-2" else "file_management"
                    usage.append({"run_id": run, "episode_id": ep.episode_id, "turn_index": t,
                                  "call_index": 0, "capability": cap, "tool": "execute_bash",
                                  "detail": "python3 -c"})  # fmt: skip
        wh.write_scores(rows)
        wh.write_usage(usage)
        wh.finish_run(run)
    return eps


@pytest.fixture(scope="module")
def warehouse_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("viewer") / "wh"
    build_warehouse(root)
    yield root


@pytest.fixture(scope="module")
def viewer(warehouse_root: Path) -> Iterator[ViewerServer]:
    srv = start_viewer(warehouse_root)
    yield srv
    srv.stop()


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "Debian's chromium is not installed: `apt-get install -y chromium` (scripts/setup.sh --test)",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="package")
def browser(short_tmp: Path) -> Iterator[Any]:
    """One Chromium for the viewer's tests. Package scope, not session: Playwright's sync
    API keeps an asyncio loop running in the main thread while it lives, and every later
    `asyncio.run` in that thread (another package's test on this worker) would refuse."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[dev]'", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=chromium_path(),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
            # Chromium binds its singleton socket under TMPDIR: a short one (tests/conftest.py)
            env={**os.environ, "TMPDIR": str(short_tmp)},
        )
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A fresh page; console errors and uncaught exceptions are collected on it."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("pageerror", lambda exc: pg.errors.append(str(exc)))  # type: ignore[attr-defined]
    pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)  # type: ignore[attr-defined]
    pg.shots = tmp_path / "screenshots"  # type: ignore[attr-defined]
    yield pg
    context.close()
    shots = tmp_path / "screenshots"
    if shots.is_dir():
        dest = ARTIFACTS / request.node.name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(shots, dest)


def shot(pg: Any, name: str) -> Path:
    """A full-page screenshot kept as a test artifact."""
    pg.shots.mkdir(parents=True, exist_ok=True)
    path = pg.shots / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    return path


__all__ = ["FAKE_KEY", "HOSTILE", "LATE_SECRET", "RUN_A", "RUN_B", "T0", "ViewerServer", "shot", "start_viewer"]
