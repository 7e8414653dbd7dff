"""The architecture is a test that can fail: the import-linter contracts hold, and every
top-level package is under them (a new package is declared in pyproject.toml or this fails)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_PACKAGES = {"tests", "benchmarks", "scripts", "docs"}  # not shipped, not layered


def test_every_package_is_under_the_contracts() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    packages = {
        p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in NOT_PACKAGES
    }
    assert packages == set(config["root_packages"]), (
        "declare new top-level packages in [tool.importlinter] root_packages and give them a layer"
    )


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_datagen_and_rl_are_siblings_between_flows_and_analysis() -> None:
    """RL data from raw text (datagen/) needs the model client and runs, like rl/; neither
    imports the other, both sit above analysis/ and below flows/ (issue #24)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c["layers"] for c in config["contracts"] if c["type"] == "layers")
    assert layers.index("rl | datagen | interop") == layers.index("flows") + 1 < layers.index("analysis")
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert "datagen*" in packages["include"]


def test_interop_sits_beside_rl_above_analysis() -> None:
    """interop/ (other tools' formats) may read analysis/ and the warehouse, never flows/ or
    the application; rl/, datagen/ and interop/ are one layer, independent of each other."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    assert layers.index("rl | datagen | interop") == layers.index("flows") + 1 < layers.index("analysis")
    forbidden = next(c for c in config["contracts"] if c.get("forbidden_modules") == ["sandflow", "typer", "rich"])
    assert "interop" in forbidden["source_modules"]


def test_the_engine_is_under_every_entry_point_and_above_the_episode() -> None:
    """engine/ (issue #23): below flows/ and rl/ (which run episodes through it), above
    analysis/ and everything an episode needs; Prefect is forbidden to it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    assert layers.index("rl | datagen | interop") < layers.index("engine") < layers.index("analysis")
    no_prefect = next(c for c in config["contracts"] if "prefect" in c.get("forbidden_modules", []))
    assert "engine" in no_prefect["source_modules"]
