"""Export bounds that hold (both backends): every entry counts, big outputs stream, the walk
stops at its caps in count and time, and the episode gets ONE summary of what was left out.

Issue #11's cases: 120,000 empty directories reached the host as "0 files, 0 skipped"; a
700 MB output under the 1 GiB limit killed the helper for memory (the archive was held,
twice); 200,000 files took 94 s to archive in full and produced 100,000 warnings.

The suite runs these cases at sizes that take seconds, with the caps scaled down to match
(the same checks); issue #11's own sizes, at the default caps, are the benchmark
benchmarks/export_bounds.py (this module with SANDFLOW_EXPORT_SCALE=full).
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
FULL = os.environ.get("SANDFLOW_EXPORT_SCALE") == "full"  # benchmarks/export_bounds.py
DEFAULT = CopyLimits()


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
def test_empty_directories_stop_at_the_entry_cap(backend: str, tmp_path: Path, test_run_id: str) -> None:
    """Issue #11: 120,000 empty folders reached the host as "0 files, 0 skipped"."""
    n, cap = (120_000, DEFAULT.max_files) if FULL else (3_000, 2_500)
    with _open(backend, f"{test_run_id}-dirs-cap-{backend}", memory_mb=1024) as sb:
        _make(sb, f"for i in range({n}): os.mkdir(f'd{{i:06}}')\n")
        sb.copy_limits = CopyLimits(max_files=cap)
        files = sb.copy_out("/testbed/output", tmp_path / "export")
    dirs, written = _entries(tmp_path / "export")
    assert (dirs, written) == (cap, 0)
    assert files.summary.skipped == {"over_count": n - cap}


@pytest.mark.slow
def test_a_big_output_streams_within_the_sandbox_memory_limit(
    backend: str, tmp_path: Path, test_run_id: str
) -> None:
    """Two thirds of the memory limit in tmpfs (700 MB of 1 GiB at issue #11's size, 256 MB
    of 384 MB here): holding the archive (once, or twice) is an OOM."""
    mb, memory_mb = (700, 1024) if FULL else (256, 384)
    with _open(backend, f"{test_run_id}-big-{backend}", memory_mb=memory_mb, tmp_size_mb=mb + 100) as sb:
        r = sb.exec(
            "mkdir -p /testbed/output && cd /testbed/output && "
            f'python3 -c "import sys\nb=bytes(range(256))*4096\nfor i in range({mb}): '
            'sys.stdout.buffer.write(b[i % 256:] + b[:i % 256])" > big.bin && '
            "sha256sum big.bin && echo 42 > answer.txt",
            timeout=300,
        )
        assert r.exit_code == 0 and not r.oom_killed, r
        want = r.stdout.split()[0]
        files = sb.copy_out("/testbed/output", tmp_path / "export")
        assert sb.exec("echo alive").stdout == "alive\n"  # the helper was not OOM-killed
    big = tmp_path / "export" / "big.bin"
    assert big.stat().st_size == mb << 20 and files.summary.skipped == {}
    h = hashlib.sha256()
    with big.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == want
    assert (tmp_path / "export" / "answer.txt").read_text() == "42\n"


@pytest.mark.slow
def test_many_files_one_summary_on_the_episode(
    backend: str, tmp_path: Path, test_run_id: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a real episode: the export stops at its caps (the count, or the time bound
    when the host writes files slowly: a loaded host creates ~2,000/s), the record carries
    one structured summary that accounts for every entry, and one warning is logged, not
    one per file. Issue #11's 200,000 files at the default caps in the benchmark; here 5,000
    at an entry cap of 2,000."""
    import sandbox.common
    from tests.chaos.test_sandbox_abuse import _abuse

    n, cap = (200_000, DEFAULT.max_files) if FULL else (5_000, 2_000)
    # every sandbox's copy limits (sandbox/common.py) with the entry cap of this size
    monkeypatch.setattr(sandbox.common, "CopyLimits", lambda: CopyLimits(max_files=cap))
    caplog.set_level(logging.WARNING, "sandflow.sandbox")
    rid = f"{test_run_id}-files-{backend}"
    make = (
        "mkdir -p /testbed/output && cd /testbed/output && echo 42 > answer.txt && "
        f"python3 -c \"[open(f'f{{i:06}}', 'w').close() for i in range({n})]\""
    )
    result = _abuse(backend, [make], tmp_path, rid, timeout_s=300, memory_mb=1024, tmp_size_mb=512)
    summary = result.record.output_export
    assert summary is not None
    skipped = summary["skipped"]
    assert summary["stopped"] in ("count", "time") and set(skipped) <= {"over_count", "time_limit"}
    if summary["stopped"] == "count":
        assert summary["files"] == cap and skipped == {"over_count": n + 1 - cap}, summary
    if summary["count_exact"]:  # every one of the n + 1 entries is accounted for
        assert summary["files"] + summary["skipped_total"] == n + 1, summary
    assert 0 < summary["files"] <= cap and summary["seconds"] <= DEFAULT.max_seconds + 5, summary
    reason = "over_count" if summary["stopped"] == "count" else "time_limit"
    assert len(summary["examples"][reason]) == 5
    assert result.record.answer == "42"
    assert len(_copy_out_warnings(caplog)) == 1
    stored = query(tmp_path / "wh", f"SELECT output_export FROM episodes WHERE run_id = '{rid}'")
    assert json.loads(stored[0][0]) == summary
