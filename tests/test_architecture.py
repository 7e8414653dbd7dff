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


def _sources(folder: Path) -> list[Path]:
    """The project's modules under `folder`: not what a run left there in a hidden folder
    (benchmarks/.peer-venv holds the peer's whole venv: 10,000 modules of other projects)."""
    return sorted(p for p in folder.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(REPO).parts))


def _library_sources() -> list[Path]:
    """Every shipped module outside sandbox/ (the backends' own home)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return sorted(path for pkg in config["root_packages"] if pkg != "sandbox" for path in _sources(REPO / pkg))


def _names_a_backend(node: object) -> bool:
    import ast

    if isinstance(node, ast.Attribute):
        return "backend" in node.attr
    if isinstance(node, ast.Name):
        return "backend" in node.id
    if isinstance(node, ast.Call):  # getattr(x, "backend", None)
        return any(_names_a_backend(a) or (isinstance(a, ast.Constant) and a.value == "backend") for a in node.args)
    return False


def test_no_backend_name_is_compared_outside_sandbox() -> None:
    """Callers ask a backend what it can do (sandbox/backends.py: `capabilities(name)`,
    `sb.capabilities`), never which one it is: a new backend is one module and one
    registration, with no `if backend == "docker"` to hunt down elsewhere (issue #38)."""
    import ast

    from sandbox.backends import backend_names

    names = set(backend_names())
    found = []
    for path in _library_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts: set[object] = set()
            for side in sides:
                if isinstance(side, ast.Constant):
                    consts.add(side.value)
                elif isinstance(side, ast.Tuple | ast.List | ast.Set):
                    consts |= {e.value for e in side.elts if isinstance(e, ast.Constant)}
            if consts & names and any(_names_a_backend(s) for s in sides):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"a backend's name compared outside sandbox/ (ask capabilities): {found}"


MAX_FUNCTION_LINES = 120


def test_no_function_is_longer_than_a_screenful_or_two() -> None:
    """A function over 120 lines (outside benchmarks/ and the in-sandbox helper, which
    stays one stdlib-only file) is split before it lands: the loop in one sitting, a CLI
    command as parse -> one library call -> print (issue #38)."""
    import ast

    long = []
    for path in _library_sources() + _sources(REPO / "sandbox"):
        if path.name == "_helper.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({size} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


RUN_DESCRIPTION = {"RunSpec", "Endpoint", "Sampling", "EpisodeLimits", "SandboxSpec", "Recording", "FanOut", "Budget"}
BUILT_BY = {"model_validate", "model_validate_json", "model_validate_strings", "model_construct"}


def _run_descriptions_built(source: str, where: str) -> list[str]:
    """Where `source` builds a run description (tasks.spec's RunSpec or one of its parts,
    however imported) itself: a call, a model_validate or a model_construct of it."""
    import ast

    tree = ast.parse(source, where)
    names: set[str] = set()  # local names of tasks.spec's classes
    modules: set[str] = set()  # local names of the module tasks.spec
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("tasks.spec", "engine"):
            names |= {a.asname or a.name for a in node.names if a.name in RUN_DESCRIPTION}
            if node.module == "engine":
                names -= {a.asname or a.name for a in node.names if a.name != "RunSpec"}
        elif isinstance(node, ast.ImportFrom) and node.module == "tasks":
            modules |= {a.asname or a.name for a in node.names if a.name == "spec"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name in ("tasks.spec", "engine")}

    def is_class(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        if isinstance(node, ast.Attribute) and node.attr in RUN_DESCRIPTION:
            base = node.value
            dotted = ast.unparse(base)
            return dotted in modules or dotted in ("tasks.spec", "engine")
        return False

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if is_class(f) or (isinstance(f, ast.Attribute) and f.attr in BUILT_BY and is_class(f.value)):
            found.append(f"{where}:{node.lineno}")
    return found


def test_a_run_description_is_built_by_its_one_builder() -> None:
    """A run is described once, by tasks.spec.build_run_spec (the application hands it its
    settings through sandflow.config.run_spec): no module, benchmarks included, builds a
    RunSpec or one of its parts itself, so a run parameter's default has one home and
    adding one is a field and the line that uses it (issue #38). Tests are excepted."""
    planted = (
        "from tasks.spec import RunSpec as R, Sampling\nimport engine\nfrom tasks import spec\n"
        "R(model='m')\nSampling()\nengine.RunSpec()\nspec.FanOut()\nR.model_validate({})\n"
        "spec.build_run_spec(model='m')\n"
    )
    assert len(_run_descriptions_built(planted, "planted.py")) == 5  # the check can fail
    found = []
    sources = _library_sources() + _sources(REPO / "sandbox") + _sources(REPO / "benchmarks")
    for path in sources:
        if path == REPO / "tasks" / "spec.py":
            continue
        found += _run_descriptions_built(path.read_text(), str(path.relative_to(REPO)))
    assert not found, f"a run description built outside tasks.spec.build_run_spec: {found}"
