"""The session-end check in tests/conftest.py fails a test run that leaks a sandbox."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sandbox import gc as G

REPO = Path(__file__).resolve().parents[2]

LEAKY = """
from sandbox import SandboxConfig, open_sandbox

_KEEP = []


def test_forgets_to_close():
    _KEEP.append(open_sandbox(SandboxConfig(run_id="pytest-leakcheck-{tag}", episode_id="leak")))
"""


def test_session_end_check_fails_a_leaking_run(
    tmp_path: Path, sandbox_image: str, docker_engine: object
) -> None:
    tag = tmp_path.name[-12:]
    test = tmp_path / "test_leaky.py"
    test.write_text(LEAKY.format(tag=tag))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            str(test),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "1 passed" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 1, "the leak must fail the run"
    assert "sandboxes leaked by this test session" in r.stderr
    # the leaked sandbox's network-namespace holder is counted (and removed) too
    assert "run=sandflow-netns-holder" in r.stderr, r.stderr
    assert [i for i in G.list_all(docker_engine, f"pytest-leakcheck-{tag}")] == []
