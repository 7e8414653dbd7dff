"""Benchmark: issue #11's export bounds at their own sizes, at the default caps, on both backends.

The suite (tests/chaos/test_export_bounds.py) checks these cases at sizes that take seconds
with the caps scaled down to match; this runs the same module with
SANDFLOW_EXPORT_SCALE=full: 120,000 empty folders stop at the default entry cap (100,000),
a 700 MB output streams out of a sandbox with a 1 GiB memory limit, and 200,000 files
through a real episode end in one summary and one warning. Each case, on docker and bwrap,
must hold; its seconds are reported.

    .venv/bin/python benchmarks/export_bounds.py

Ends with ONE JSON line: benchmark, passed, failed, seconds (per case), pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = "entry_cap or big_output or many_files"


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="sandflow-bench-export-") as tmp:
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
             "tests/chaos/test_export_bounds.py", "-k", CASES, f"--junitxml={junit}"],
            cwd=REPO, env={**os.environ, "SANDFLOW_EXPORT_SCALE": "full"},
        )  # fmt: skip
        cases = ET.parse(junit).getroot().iter("testcase") if junit.exists() else iter(())
        seconds, failed = {}, 0
        for case in cases:
            seconds[case.get("name", "?")] = round(float(case.get("time", 0)), 1)
            failed += case.find("failure") is not None or case.find("error") is not None
    passed = len(seconds) - failed
    for name, s in seconds.items():
        print(f"{name}: {s} s")
    ok = proc.returncode == 0 and passed == 6
    print(json.dumps({"benchmark": "export_bounds", "passed": passed, "failed": failed,
                      "seconds": seconds, "pass": ok}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
