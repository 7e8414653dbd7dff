"""Episode progress: live bars on a terminal, plain lines a log can show without one."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rich.console import Console

from engine import progress
from sandflow.commands.progress import LineEpisodeProgress, RichEpisodeProgress

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[")


def test_line_mode_coalesces_changes_and_reports_every_figure() -> None:
    lines: list[str] = []
    p = LineEpisodeProgress("episodes", write=lines.append, interval_s=3600, heartbeat_s=3600)
    with p:
        progress.planned(total=4, skipped=0, run_id="r-1")
        for k in ("a", "b", "c"):
            progress.started(k)
        progress.finished("a", ok=True, termination="submitted")
        progress.attempt_failed("b")
        progress.finished("b", ok=False, termination="failed")
        now = time.monotonic()
        assert p.tick(now + 3601)  # due: one line for all the changes above
        assert not p.tick(now + 3602)  # nothing changed since, heartbeat not due
    assert lines[0] == "episodes: run r-1, 4 to do"
    line = lines[1]
    assert line.startswith("episodes 2/4 done, 1 running, 1 failed, 1 retries, ")
    assert re.search(r"\d+\.\d\d ep/s, elapsed \S+, ETA \S+$", line), line
    assert len(lines) == 2  # the final line is not repeated when nothing changed


def test_line_mode_heartbeat_and_final_line() -> None:
    lines: list[str] = []
    p = LineEpisodeProgress("episodes", write=lines.append, interval_s=3600, heartbeat_s=10)
    with p:
        progress.planned(total=2, skipped=1, run_id="r-2")
        now = time.monotonic()
        assert p.tick(now + 3601)
        assert not p.tick(now + 3605)
        assert p.tick(now + 3612)  # heartbeat: unchanged but alive
        progress.started("x")
        progress.finished("x", ok=True, termination="submitted")
    assert "1 done before: resumed" in lines[0]
    assert lines[-1].startswith("episodes 1/2 done, 0 running, 0 failed")  # written at exit
    assert "ETA 0s" in lines[-1]


def test_nothing_is_printed_before_the_run_plans_its_work() -> None:
    lines: list[str] = []
    with LineEpisodeProgress("episodes", write=lines.append, interval_s=0.05) as p:
        time.sleep(0.2)
        assert not p.tick(time.monotonic() + 100)
    assert lines == []


def test_without_a_tty_a_subprocess_prints_plain_lines_every_few_seconds_of_change() -> None:
    script = textwrap.dedent(
        """
        import time
        from engine import progress
        from sandflow.commands.progress import RichEpisodeProgress
        with RichEpisodeProgress("episodes"):
            progress.planned(total=6, skipped=0, run_id="r-3")
            for i in range(6):
                progress.started(str(i))
                time.sleep(0.15)
                progress.finished(str(i), ok=i != 4, termination="submitted")
        print("END")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "SANDFLOW_PROGRESS_INTERVAL_S": "0.3", "TERM": "xterm"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert not ANSI.search(out), out  # no escape codes, no carriage-return bars in a log
    lines = [ln for ln in out.splitlines() if ln.startswith("episodes ")]
    assert lines[0].startswith("episodes 0/6 done") or lines[0].startswith("episodes 1/6 done")
    assert 2 <= len(lines) <= 6, lines  # coalesced: not one per event, yet more than the last
    assert lines[-1].startswith("episodes 6/6 done, 0 running, 1 failed"), lines
    assert out.rstrip().endswith("END")


def test_with_a_tty_the_live_bar_is_kept() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160, color_system="standard")
    bar = RichEpisodeProgress("episodes", console=console)
    assert bar._lines is None  # the rich bar, not log lines
    with bar:
        progress.planned(total=3, skipped=0, run_id="r-4")
        progress.started("a")
        progress.finished("a", ok=True, termination="submitted")
    out = buf.getvalue()
    assert ANSI.search(out)
    assert "1/3" in out and "ep/s" in out and "episodes 1/3 done" not in out


def test_a_non_terminal_console_gets_lines_through_that_console() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=40)
    with RichEpisodeProgress("episodes", console=console) as bar:
        assert bar._lines is not None
        progress.planned(total=1, skipped=0, run_id="r-5")
        progress.finished("a", ok=True, termination="submitted")
    text = buf.getvalue()
    assert not ANSI.search(text)
    # one line each, never wrapped at the console's width
    assert any(
        ln.startswith("episodes 1/1 done, 0 running, 0 failed, 0 retries") and "ETA" in ln
        for ln in text.splitlines()
    ), text


def test_a_second_run_in_one_display_counts_from_zero() -> None:
    """A data build shows its synthesis, then its calibration run, in one display: the
    second run's counts never add to the first's ("118/36 done" was shown)."""
    lines: list[str] = []
    p = LineEpisodeProgress("items", write=lines.append, interval_s=3600, heartbeat_s=3600)
    with p:
        progress.planned(total=3, skipped=0, run_id="build-1")
        for k in ("a", "b", "c"):
            progress.finished(k, ok=k != "c", termination="kept")
        progress.planned(total=2, skipped=0, run_id="build-1-cal")
        progress.finished("x", ok=True, termination="submitted")
        assert p.tick(time.monotonic() + 3601)
    assert lines[-1].startswith("items 1/2 done, 0 running, 0 failed, "), lines
