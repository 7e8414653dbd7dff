"""Venvs of their own for consumer packages that cannot share sandflow's .venv.

verifiers 0.4.0 pins openai < 3 and openenv-core 0.3.0 pulls gradio (which pins pillow
< 13): installing either into the shared .venv would change packages other tests rely on.
`consumer_venv` builds `tests/.venvs/NAME` (or `$SANDFLOW_<NAME>_VENV`) once, from PyPI:
the consumer package and its own dependencies first on the path, then this checkout and
the running interpreter's site-packages (sandflow's dependencies) after them, so the
consumer's process imports sandflow as the extra (`pip install sandflow[NAME]`) would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERIFIERS = "verifiers==0.4.0"
OPENENV = "openenv-core==0.3.0"


def consumer_venv(name: str, packages: list[str], probe: str) -> Path:
    """The venv's python (built when missing or broken; `probe` is code it must run)."""
    root = Path(os.environ.get(f"SANDFLOW_{name.upper()}_VENV") or REPO / "tests" / ".venvs" / name)
    py = root / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0
    if not ok:
        if root.exists():  # only ever a venv of ours: never remove anything else
            if not (root / "pyvenv.cfg").is_file():
                pytest.fail(f"{root} exists and is not a venv: set SANDFLOW_{name.upper()}_VENV to a new folder")
            shutil.rmtree(root)
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", str(root)], check=True)
        r = subprocess.run(
            [str(root / "bin" / "pip"), "install", "-q", *packages],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        if r.returncode != 0:
            pytest.fail(f"pip install {' '.join(packages)} failed: {(r.stderr or r.stdout)[-1500:]}")
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # .pth files are read in name order and append to sys.path: the consumer's own
    # packages stay first; this checkout, then sandflow's dependencies, come after.
    (Path(site) / "zz_sandflow_checkout.pth").write_text(f"{REPO}\n")
    (Path(site) / "zzz_sandflow_deps.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
    return py
