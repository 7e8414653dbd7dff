"""scripts/setup.sh's background steps: a failing step fails the script with its name,
exit code and the end of its log; steps still running are stopped on the way out."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def helpers() -> str:
    text = (REPO / "scripts" / "setup.sh").read_text()
    start = text.index("T0=$(date +%s)")
    end = text.index("trap stop_jobs EXIT") + len("trap stop_jobs EXIT")
    return text[start:end]


def test_a_failed_background_step_fails_setup_loudly_and_stops_the_others(tmp_path: Path) -> None:
    marker = tmp_path / "still-running"
    script = tmp_path / "jobs.sh"
    script.write_text(
        "set -euo pipefail\n"
        f"SANDFLOW_SETUP_LOGS={tmp_path}/logs\n"
        + helpers()
        + "\nstart ok-step bash -c 'echo fine'\n"
        "start bad-step bash -c 'echo building; echo \"boom: mirror unreachable\" >&2; exit 3'\n"
        f"start slow-step bash -c 'sleep 30; touch {marker}'\n"
        "finish ok-step\nfinish bad-step\necho NOT-REACHED\n"
    )
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "NOT-REACHED" not in proc.stdout
    assert "ok-step: done in" in proc.stdout
    assert "bad-step failed (exit 3)" in proc.stderr and "boom: mirror unreachable" in proc.stderr
    assert (tmp_path / "logs" / "bad-step.log").read_text().startswith("building")  # log kept
    slow = subprocess.run(["pgrep", "-f", f"touch {marker}"], capture_output=True, text=True)
    assert slow.stdout.strip() == ""  # stopped with the script, not left behind
    time.sleep(0.2)
    assert not marker.exists()
