"""Venvs of their own for consumer packages that cannot share sandflow's .venv.

verifiers 0.4.0 pins openai < 3 and openenv-core 0.3.0 pulls gradio (which pins pillow
< 13): installing either into the shared .venv would change packages other tests rely on.
`consumer_venv` builds a venv once, from PyPI, in the test-venv cache
(~/.cache/sandflow/test-venvs/NAME-HASH, or `$SANDFLOW_<NAME>_VENV`):
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


def _cache_root() -> Path:
    """Where consumer venvs live: outside the checkout, so a fresh clone on the same machine
    (CI's) reuses them; each is named by a hash of what it holds, so a changed pin is a
    new venv, never a stale one."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandflow" / "test-venvs"


def venv_python(
    name: str, packages: list[str] | tuple[str, ...], probe: str, *,
    base_python: str | None = None, env: dict[str, str] | None = None, timeout_s: float = 1800,
) -> Path:
    """The python of a venv holding `packages` (built when missing or broken; `probe` is
    code it must run), at `$SANDFLOW_<NAME>_VENV` or in the test-venv cache. The one home
    of every consumer venv of the suite (harbor, LIS-RL's reward, verifiers, OpenEnv)."""
    import hashlib

    base = base_python or getattr(sys, "_base_executable", None) or sys.executable
    key = hashlib.sha256("\n".join([base, *packages]).encode()).hexdigest()[:10]
    given = os.environ.get(f"SANDFLOW_{name.upper().replace('-', '_')}_VENV")
    root = Path(given) if given else _cache_root() / f"{name}-{key}"
    py = root / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True, env=env).returncode == 0:
        return py
    if root.exists():  # only ever a venv of ours: never remove anything else
        if not (root / "pyvenv.cfg").is_file():
            pytest.fail(f"{root} exists and is not a venv: set SANDFLOW_{name.upper()}_VENV to a new folder")
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([base, "-m", "venv", str(root)], check=True)
    r = subprocess.run(
        [str(root / "bin" / "pip"), "install", "-q", *packages],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    if r.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)  # a half-built venv is not left to probe later
        pytest.fail(f"pip install {' '.join(packages)} failed: {(r.stderr or r.stdout)[-1500:]}")
    return py


def consumer_venv(name: str, packages: list[str], probe: str) -> Path:
    """A consumer's venv that imports this checkout as its extra would: its own packages
    first on the path, then this checkout, then sandflow's dependencies."""
    py = venv_python(name, packages, probe)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # .pth files are read in name order and append to sys.path: the consumer's own
    # packages stay first; this checkout, then sandflow's dependencies, come after.
    (Path(site) / "zz_sandflow_checkout.pth").write_text(f"{REPO}\n")
    (Path(site) / "zzz_sandflow_deps.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
    return py
