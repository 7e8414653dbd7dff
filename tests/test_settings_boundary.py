"""Libraries are handed their settings (issue #23): they never read SANDFLOW_* and never
change the process environment when imported.

Only the application (sandflow/) resolves SANDFLOW_* (sandflow/host.py, sandflow/config.py)
and hands plain values down; the in-sandbox helper (sandbox/_helper.py) reads the values
the backends hand it. A library may follow a tool's own convention (DOCKER_HOST, PREFECT_*,
HF_*, XDG_CACHE_HOME). Handing values to the helper (a dict of the container's
environment) or scrubbing secrets is not reading.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
APPLICATION = {"sandflow"}
NOT_LIBRARIES = {"tests", "benchmarks", "scripts", "docs"}
PREFIX = "SANDFLOW_"

# file -> why it may read these SANDFLOW_* variables (and only these)
ALLOWED: dict[str, tuple[set[str], str]] = {
    "sandbox/_helper.py": (
        {"*"},
        "runs inside the sandbox: its settings are the values the backends hand it",
    ),
    "tasks/model.py": (
        {"SANDFLOW_API_KEY"},
        "the API key is a secret: it never travels as a value (a RunSpec is a Prefect "
        "parameter, and Prefect stores parameters), so the process that calls the model "
        "looks it up (api_key_from_env), Dask workers included",
    ),
    "datasets_prep/secrets.py": (
        {"SANDFLOW_API_KEY", "SANDFLOW_JUDGE_API_KEY"},
        "scrubbing: the secrets' values are looked up only to keep them out of task data",
    ),
}


def library_packages() -> list[str]:
    """Every top-level package of ours except the application (new ones included)."""
    return sorted(
        p.name
        for p in REPO.iterdir()
        if (p / "__init__.py").is_file() and p.name not in APPLICATION | NOT_LIBRARIES
    )


class _EnvReads(ast.NodeVisitor):
    """`os.environ[...]`, `os.environ.get/pop/setdefault(...)`, `os.getenv(...)`,
    `... in os.environ` (also through a name bound to os.environ) whose key is a SANDFLOW_
    string: a literal, an f-string or concatenation starting with it, a module constant, a
    loop variable over a constant tuple, a call of a module function that builds one; and `startswith("SANDFLOW_")` in a module that
    touches os.environ (a scan by prefix)."""

    def __init__(self, tree: ast.Module) -> None:
        self.constants: dict[str, list[str]] = {}
        self.builders: dict[str, list[str]] = {}
        self.environ_names = {"environ"}
        self.touches_environ = False
        self.found: list[tuple[int, str]] = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                values = self._strings(node.value)
                if values:
                    self.constants[node.targets[0].id] = values
        for node in tree.body:  # functions that build a setting's name: def env_name(f): return f"SANDFLOW_{f}"
            if isinstance(node, ast.FunctionDef):
                built = [v for r in ast.walk(node) if isinstance(r, ast.Return) and r.value for v in self._strings(r.value)]
                if built:
                    self.builders[node.name] = built
        for node in ast.walk(tree):  # names bound to os.environ (env = os.environ if ... else ...)
            if isinstance(node, ast.Assign) and any(self._is_os_environ(n) for n in ast.walk(node.value)):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.environ_names.add(t.id)
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
                values = self._key(node.iter)
                if values:
                    self.constants[node.target.id] = values

    @staticmethod
    def _is_os_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"

    def _is_environ(self, node: ast.AST) -> bool:
        return self._is_os_environ(node) or (isinstance(node, ast.Name) and node.id in self.environ_names)

    def _strings(self, node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value] if node.value.startswith(PREFIX) else []
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith(PREFIX):
                return [str(first.value) + "..."]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return [s + "..." for s in self._strings(node.left)]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [s for e in node.elts for s in self._strings(e)]
        return []

    def _key(self, node: ast.AST) -> list[str]:
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.constants[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.builders:
            return self.builders[node.func.id]
        return self._strings(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        key = node.args[0] if node.args else None
        if isinstance(f, ast.Attribute):
            if self._is_environ(f.value):
                self.touches_environ = True
                if f.attr in ("get", "pop", "setdefault", "__getitem__") and key is not None:
                    for name in self._key(key):
                        self.found.append((node.lineno, name))
            if f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os" and key is not None:
                for name in self._key(key):
                    self.found.append((node.lineno, name))
            if f.attr == "startswith" and key is not None and self._strings(key):
                self.found.append((node.lineno, "startswith " + self._strings(key)[0]))
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if self._is_environ(node.value):
            self.touches_environ = True
            for name in self._key(node.slice):
                self.found.append((node.lineno, name))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
            self._is_environ(c) for c in node.comparators
        ):
            self.touches_environ = True
            for name in self._key(node.left):
                self.found.append((node.lineno, name))
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        """`if __name__ == "__main__":` is a script's own entry point (setup.sh runs
        sandbox/image.py and datasets_prep.nltk_setup so): like the application, it reads
        its settings and hands them to the library."""
        test = node.test
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
        ):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)


def env_reads(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    scan = _EnvReads(tree)
    scan.visit(tree)
    return [(line, name) for line, name in scan.found if not name.startswith("startswith") or scan.touches_environ]


def test_the_scan_finds_every_way_a_library_could_read_a_setting(tmp_path: Path) -> None:
    """The scan itself can fail: each of these spellings is caught, the allowed ones are not."""
    src = tmp_path / "m.py"
    src.write_text(
        "import os\n"
        'ENV = "SANDFLOW_A"\n'
        'NAMES = ("SANDFLOW_B", "OTHER")\n'
        'x = os.environ.get("SANDFLOW_C", "1")\n'
        "y = os.environ[ENV]\n"
        'z = os.getenv(f"SANDFLOW_{x.upper()}")\n'
        'def env_name(field):\n'
        '    return f"SANDFLOW_{field.upper()}_BYTES"\n'
        'w = os.environ.get(env_name("max"))\n'
        "def f(env=None):\n"
        "    env = os.environ if env is None else env\n"
        "    for name in NAMES:\n"
        "        env.get(name)\n"
        '    return "SANDFLOW_D" in os.environ, [k for k in os.environ if k.startswith("SANDFLOW_")]\n'
        'docker = os.environ.get("DOCKER_HOST")\n'
        'handed = {"SANDFLOW_WORKDIR": "/testbed"}\n'
        'if __name__ == "__main__":\n'
        '    os.environ.get("SANDFLOW_SCRIPT")\n'
    )
    names = sorted(name for _, name in env_reads(src))
    assert names == [
        "SANDFLOW_...", "SANDFLOW_...", "SANDFLOW_A", "SANDFLOW_B", "SANDFLOW_C", "SANDFLOW_D", "startswith SANDFLOW_",
    ], names


def test_no_library_module_reads_a_sandflow_setting() -> None:
    packages = library_packages()
    assert {"sandbox", "datasets_prep", "tasks", "warehouse", "analysis", "rl", "flows"} <= set(packages)
    problems = []
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            allowed, _why = ALLOWED.get(rel, (set(), ""))
            for line, name in env_reads(path):
                if "*" in allowed or name in allowed:
                    continue
                problems.append(f"{rel}:{line} reads {name}")
    assert not problems, (
        "library code reads SANDFLOW_* settings; resolve them in the application "
        "(sandflow/host.py or sandflow/config.py) and hand the values down:\n" + "\n".join(problems)
    )


_IMPORT_ALL = r"""
import importlib, json, os, pkgutil, sys
sys.path.insert(0, sys.argv[1])
packages = json.loads(sys.argv[2])
before = dict(os.environ)
changed, failed, imported = {}, {}, 0
for package in packages:
    names = [package] + [m.name for m in pkgutil.walk_packages([os.path.join(sys.argv[1], package)], package + ".")]
    for name in names:
        if name == "sandbox._helper":
            continue  # runs inside the sandbox only
        snapshot = dict(os.environ)
        try:
            importlib.import_module(name)
            imported += 1
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
        now = dict(os.environ)
        if now != snapshot:
            keys = sorted(k for k in set(now) | set(snapshot) if now.get(k) != snapshot.get(k))
            changed[name] = keys
            os.environ.clear(); os.environ.update(snapshot)
print(json.dumps({"changed": changed, "failed": failed, "imported": imported}))
"""


@pytest.mark.slow
def test_importing_every_library_module_leaves_the_environment_unchanged() -> None:
    """Once `import flows` set Prefect's, Dask's and Hugging Face's variables in the
    process environment; now whoever starts the process does (the CLI, the tests'
    conftest, a benchmark), and no import changes it."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("PREFECT_", "HF_", "DASK_", "DO_NOT_TRACK"))}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(REPO), json.dumps(library_packages())],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported"] > 100, result
    assert result["changed"] == {}, result["changed"]
    # modules of an optional extra that cannot share this venv (docs/interop.md, "Trainers'
    # packages"): importing them without it is the one failure allowed
    failed = {
        name: why for name, why in result["failed"].items()
        if not (name in EXTRA_ONLY and why == f"ModuleNotFoundError: No module named '{EXTRA_ONLY[name]}'")
    }
    assert failed == {}, failed


EXTRA_ONLY = {  # module -> the package of its extra (not installable beside prefect's pins)
    "rl.verifiers_env": "verifiers",
    "sandflow_env": "verifiers",
    "rl.openenv_server": "openenv",
}


def test_a_run_carries_the_sandbox_settings_to_the_processes_that_run_its_episodes(
    host_settings: Any, tmp_path: Path
) -> None:
    """A Dask worker never runs the CLI: the RunSpec (a Prefect parameter, JSON) carries the
    sandbox settings the application handed in, and each episode applies them."""
    from engine.episode import use_host_settings
    from sandbox import settings
    from tasks.spec import RunSpec

    host_settings(engine_call_timeout_s=7, netns_reuse=False, cache_dir=tmp_path)
    spec = RunSpec(task_set="smoke")
    carried = RunSpec.model_validate_json(spec.model_dump_json())  # as Prefect/Dask move it
    assert carried.sandbox.host == {"engine_call_timeout_s": 7, "netns_reuse": False, "cache_dir": str(tmp_path)}
    settings.configure(settings.HostSettings())  # a fresh worker process: the defaults
    use_host_settings(carried)
    now = settings.current()
    assert (now.engine_call_timeout_s, now.netns_reuse, now.cache_dir) == (7, False, tmp_path)


def test_the_cli_hands_the_environment_to_the_libraries(tmp_path: Path) -> None:
    """SANDFLOW_* and the config file reach the libraries through the application."""
    (tmp_path / "sandflow.toml").write_text('egress_cache_mb = 10\nmax_text_bytes = 1000\n')
    code = (
        "import os, sys; sys.argv = ['sandflow', 'tasks', 'suites']\n"
        "from sandflow.cli import app\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\n"
        "from sandbox import settings; from datasets_prep import limits, settings as data\n"
        "s = settings.current()\n"
        "print('RESULT', s.engine_call_timeout_s, s.netns_reuse, s.egress_cache_mb, s.cache_dir,"
        " limits.LIMITS.max_text_bytes, data.current().python_docs)\n"
    )
    env = {
        **__import__("os").environ,
        "SANDFLOW_CONFIG": str(tmp_path / "sandflow.toml"),
        "SANDFLOW_ENGINE_CALL_TIMEOUT_S": "90",
        "SANDFLOW_NETNS_REUSE": "0",
        "SANDFLOW_CACHE_DIR": str(tmp_path / "cache"),
        "SANDFLOW_PYTHON_DOCS": str(tmp_path / "docs"),
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line == f"RESULT 90.0 False 10 {tmp_path / 'cache'} 1000 {tmp_path / 'docs'}", proc.stdout[-2000:] + proc.stderr[-2000:]
