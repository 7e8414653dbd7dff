"""analysis/ stays pure (issue #23): it computes rows, it never writes files.

The import contract (pyproject, lint-imports) keeps engines and DuckDB out of analysis/,
but it sees packages, not what a module does with pyarrow. This reads every module of
analysis/ and fails on a Parquet writer: pyarrow.parquet / pyarrow.dataset imports or a
call to write_table / to_parquet / write_dataset. Writing RL exports is the store's job
(warehouse.exports.write_export, called by flows/rollouts.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

ANALYSIS = Path(__file__).resolve().parents[2] / "analysis"
WRITERS = {"write_table", "to_parquet", "write_dataset", "write_to_dataset", "ParquetWriter"}
MODULES = {"pyarrow.parquet", "pyarrow.dataset"}


def _problems(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [f"imports {a.name}" for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.module in MODULES:
                out.append(f"imports {node.module}")
            elif node.module == "pyarrow":
                out += [f"imports pyarrow.{a.name}" for a in node.names if a.name in ("parquet", "dataset")]
        elif isinstance(node, ast.Attribute) and node.attr in WRITERS:
            out.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in WRITERS:
            out.append(f"line {node.lineno}: {node.id}")
    return [f"{path.name}: {p}" for p in out]


def test_no_module_of_analysis_writes_parquet() -> None:
    files = sorted(ANALYSIS.rglob("*.py"))
    assert len(files) > 5
    problems = [p for f in files for p in _problems(f)]
    assert problems == []


def test_the_check_catches_a_writer(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pyarrow.parquet as pq\n\ndef f(t, p):\n    pq.write_table(t, p)\n")
    assert _problems(bad) == ["bad.py: imports pyarrow.parquet", "bad.py: line 4: .write_table"]
