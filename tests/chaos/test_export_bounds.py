"""Export bounds that hold (both backends): every entry counts, big outputs stream, the walk
stops at its caps in count and time, and the episode gets ONE summary of what was left out.

Issue #11's cases: 120,000 empty directories reached the host as "0 files, 0 skipped"; a
700 MB output under the 1 GiB limit killed the helper for memory (the archive was held,
twice); 200,000 files took 94 s to archive in full and produced 100,000 warnings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from sandbox import SandboxConfig, SandboxLimits, open_sandbox
from sandbox.archive import CopyLimits
from tests.chaos.conftest import query

pytestmark = [pytest.mark.chaos]


@pytest.fixture(params=["docker", "bwrap"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue("sandbox_image" if request.param == "docker" else "sandbox_rootfs")
    return str(request.param)


def _open(backend: str, run_id: str, **limits: Any) -> Any:
    lim = {"memory_mb": 512, "pids": 256, "tmp_size_mb": 256, **limits}
    return open_sandbox(SandboxConfig(backend=backend, run_id=run_id, limits=SandboxLimits(**lim)))


def _make(sb: Any, python: str) -> None:
    """Fill /testbed/output from inside the sandbox (python3 of the image)."""
    sb.write_file(
        "/tmp/make.py",
        "import os\nos.makedirs('/testbed/output', exist_ok=True)\n"
        "os.chdir('/testbed/output')\n" + python,
    )
    r = sb.exec("python3 /tmp/make.py", timeout=300)
    assert r.exit_code == 0, r.stderr


def _entries(root: Path) -> tuple[int, int]:
    """(folders, files) under root, root itself excepted."""
    dirs = files = 0
    for _, dnames, fnames in os.walk(root):
        dirs += len(dnames)
        files += len(fnames)
    return dirs, files


def _copy_out_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("copy_out")]


def test_directories_count_against_the_entry_cap(
    backend: str, tmp_path: Path, test_run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "sandflow.sandbox")
    with _open(backend, f"{test_run_id}-dirs-{backend}") as sb:
        _make(
            sb, "open('answer.txt', 'w').write('42')\nfor i in range(30000): os.mkdir(f'd{i:05}')\n"
        )
        sb.copy_limits = CopyLimits(max_files=2000)
        files = sb.copy_out("/testbed/output", tmp_path / "export")
    dirs, written = _entries(tmp_path / "export")
    assert dirs + written == 2000  # folders are entries: 1 file + 1,999 folders, no more
    assert (written, dirs) == (1, 1999) and (tmp_path / "export" / "answer.txt").read_text() == "42"
    s = files.summary
    assert (s.files, s.dirs) == (1, 1999)
    # Exact at the capped folder's level; a loaded host may run out of the 1 s it gives
    # itself to look into the 28,001 folders left out (count_exact False, shown as "+").
    assert s.skipped == {"over_count": 30001 - 2000} and s.stopped == "count"
    assert s.examples["over_count"][0] == "output/d01999"
    warnings = _copy_out_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert re.search(r"28001\+? over the entry-count limit of 2000", warnings[0]), warnings


def test_export_stops_at_its_time_bound_and_says_what_it_left(
    backend: str, tmp_path: Path, test_run_id: str
) -> None:
    with _open(backend, f"{test_run_id}-time-{backend}") as sb:
        _make(sb, "for i in range(20000): open(f'f{i:05}', 'w').close()\n")
        sb.copy_limits = CopyLimits(max_seconds=0.001)  # spent before the first entry
        files = sb.copy_out("/testbed/output", tmp_path / "export")
    s = files.summary
    assert s.stopped == "time" and s.count_exact
    assert s.files + s.skipped["time_limit"] == 20000, s.as_dict()
    assert any("time limit" in why for _, why in files.skipped)


@pytest.mark.slow
def test_120000_empty_directories_stop_at_the_default_cap(
    backend: str, tmp_path: Path, test_run_id: str
) -> None:
    with _open(backend, f"{test_run_id}-dirs120k-{backend}", memory_mb=1024) as sb:
        _make(sb, "for i in range(120000): os.mkdir(f'd{i:06}')\n")
        files = sb.copy_out("/testbed/output", tmp_path / "export")
    dirs, written = _entries(tmp_path / "export")
    assert (dirs, written) == (100_000, 0)
    assert files.summary.skipped == {"over_count": 20_000}


@pytest.mark.slow
def test_700mb_output_streams_within_the_sandbox_memory_limit(
    backend: str, tmp_path: Path, test_run_id: str
) -> None:
    """700 MB in tmpfs + a 1 GiB memory limit: holding the archive (once, or twice) is an OOM."""
    with _open(backend, f"{test_run_id}-700mb-{backend}", memory_mb=1024, tmp_size_mb=800) as sb:
        r = sb.exec(
            "mkdir -p /testbed/output && cd /testbed/output && "
            'python3 -c "import sys\nb=bytes(range(256))*4096\nfor i in range(700): '
            'sys.stdout.buffer.write(b[i % 256:] + b[:i % 256])" > big.bin && '
            "sha256sum big.bin && echo 42 > answer.txt",
            timeout=300,
        )
        assert r.exit_code == 0 and not r.oom_killed, r
        want = r.stdout.split()[0]
        files = sb.copy_out("/testbed/output", tmp_path / "export")
        assert sb.exec("echo alive").stdout == "alive\n"  # the helper was not OOM-killed
    big = tmp_path / "export" / "big.bin"
    assert big.stat().st_size == 700 << 20 and files.summary.skipped == {}
    h = hashlib.sha256()
    with big.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == want
    assert (tmp_path / "export" / "answer.txt").read_text() == "42\n"


@pytest.mark.slow
def test_200000_files_one_summary_on_the_episode(
    backend: str, tmp_path: Path, test_run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a real episode: the export stops at the default caps (the count, or the 60 s
    time bound when the host writes files slowly: a loaded host creates ~2,000/s), the record
    carries one structured summary that accounts for every entry, and one warning is logged,
    not 100,000."""
    from tests.chaos.test_sandbox_abuse import _abuse

    caplog.set_level(logging.WARNING, "sandflow.sandbox")
    rid = f"{test_run_id}-200k-{backend}"
    make = (
        "mkdir -p /testbed/output && cd /testbed/output && echo 42 > answer.txt && "
        "python3 -c \"[open(f'f{i:06}', 'w').close() for i in range(200000)]\""
    )
    result = _abuse(backend, [make], tmp_path, rid, timeout_s=300, memory_mb=1024, tmp_size_mb=512)
    summary = result.record.output_export
    assert summary is not None
    skipped = summary["skipped"]
    assert summary["stopped"] in ("count", "time") and set(skipped) <= {"over_count", "time_limit"}
    if summary["stopped"] == "count":
        assert summary["files"] == 100_000 and skipped == {"over_count": 100_001}, summary
    if summary["count_exact"]:  # every one of the 200,001 entries is accounted for
        assert summary["files"] + summary["skipped_total"] == 200_001, summary
    assert 0 < summary["files"] <= 100_000 and summary["seconds"] <= 60 + 5, summary
    reason = "over_count" if summary["stopped"] == "count" else "time_limit"
    assert len(summary["examples"][reason]) == 5
    assert result.record.answer == "42"
    assert len(_copy_out_warnings(caplog)) == 1
    stored = query(tmp_path / "wh", f"SELECT output_export FROM episodes WHERE run_id = '{rid}'")
    assert json.loads(stored[0][0]) == summary
