"""The usage rules on a labelled list of real commands (as models actually write them)."""

from __future__ import annotations

import json

import pytest

from analysis.usage_rules import (
    RULES,
    label_bash,
    label_tool_call,
    label_turn,
    primary_label,
    rules_table,
)

C, F, E = "computation", "file_management", "external_resource"

# (command, expected capabilities). Collected from agent trajectories of the kind the
# paper analyses; every rule family appears at least once, and so do the traps
# (pip list is not a download, `python -m pip install` is not computation, a heredoc
# body is not a command line, 2>/dev/null is not a file write).
LABELLED: list[tuple[str, set[str]]] = [
    ("python3 script.py", {C}),
    ("python solve.py --n 10", {C}),
    ('python3 -c "import sympy; print(sympy.factorint(2**64-1))"', {C}),
    ("cd /testbed && python3 solve.py", {C}),
    ("timeout 60 python3 brute_force.py", {C}),
    ("python3 - <<'EOF'\nfrom math import comb\nprint(comb(10, 3))\nEOF", {C}),
    ("node compute.js", {C}),
    ("gcc -O2 a.c -o a && ./a", {C}),
    ("./run.sh", {C}),
    ("bash solve.sh", {C}),
    ("echo '2^100' | bc", {C}),
    ("awk '{s+=$1} END {print s}' numbers.txt", {C}),
    ("pytest -q tests/", {C}),
    ("pip install rdkit", {E}),
    ("pip3 install --quiet pubchempy", {E}),
    ("python3 -m pip install rdkit-pypi", {E}),
    ("apt-get install -y openbabel", {E}),
    ("conda install -c conda-forge rdkit", {E}),
    ("curl -s https://pubchem.ncbi.nlm.nih.gov/rest/pug/compound/name/aspirin/JSON", {E}),
    ("wget -q http://example.org/data.csv -O data.csv", {E}),
    ("git clone https://github.com/rdkit/rdkit.git", {E}),
    ("ping -c 1 8.8.8.8", {E}),
    ("python3 - <<'EOF'\nimport urllib.request\nprint(urllib.request.urlopen(u).read())\nEOF", {C, E}),
    ('python3 -c "import requests; requests.get(\'https://api.example.com\')"', {C, E}),
    ("pip install numpy && python3 fit.py", {E, C}),
    ("cat /testbed/documents/report.txt", {F}),
    ("ls -la /testbed/input", {F}),
    ("ls", {F}),
    ("head -n 50 chapter1.txt", {F}),
    ("tail -20 log.txt", {F}),
    ("wc -l *.txt", {F}),
    ("find /testbed -name '*.csv'", {F}),
    ("grep -n 'Hamlet' /testbed/documents/*.txt", {F}),
    ("sed -i 's/foo/bar/g' config.py", {F}),
    ("sed -n '100,140p' play.txt", {F}),
    ("mkdir -p /testbed/output", {F}),
    ("cp input/data.csv output/ && mv a.txt b.txt", {F}),
    ("rm -rf /tmp/scratch", {F}),
    ("echo 42 > /testbed/output/answer.txt", {F}),
    ("echo 'B' >> /testbed/output/answer.txt", {F}),
    ("printf '%s\\n' 17 > answer.txt", {F}),
    ("cat > solve.py << 'EOF'\nimport numpy as np\nprint(np.pi)\nEOF", {F}),
    ("cat > solve.py << 'EOF'\nprint(1)\nEOF\npython3 solve.py", {F, C}),
    ("python3 solve.py > result.txt 2>&1", {C, F}),
    ("python3 solve.py 2>/dev/null", {C}),
    ("echo hi | tee notes.txt", {F}),
    ("tar xzf data.tar.gz", {F}),
    ("unzip -o archive.zip", {F}),
    ("sort names.txt | uniq -c | sort -rn | head", {F}),
    ("diff a.txt b.txt", {F}),
    ("git status", {F}),
    ("pwd", set()),
    ("cd /testbed", set()),
    ("echo hello", set()),
    ("whoami; uname -a", set()),
    ("pip list", set()),
    ("pip show numpy", set()),
    ("which python3", set()),
    ("sleep 1", set()),
    ("", set()),
    ("frobnicate --all", set()),
    ('bash -c "pip install sympy"', {E}),
    ("sudo -n python3 x.py", {C}),
    ("FOO=1 python3 x.py", {C}),
    ('echo "unbalanced quote', set()),
]


@pytest.mark.parametrize("command,expected", LABELLED, ids=[c[:40] for c, _ in LABELLED])
def test_labelled_commands(command: str, expected: set[str]) -> None:
    assert label_bash(command) == expected


def test_editor_is_file_management_and_submit_is_none() -> None:
    for sub in ("view", "create", "str_replace", "insert", "undo_edit"):
        args = json.dumps({"command": sub, "path": "/testbed/x.py"})
        assert label_tool_call("str_replace_editor", args) == {F}
    assert label_tool_call("submit", "{}") == set()
    assert label_tool_call("execute_bash", "{not json") == set()
    assert label_tool_call("no_such_tool", json.dumps({"command": "python3 x.py"})) == set()


def test_turn_is_the_union_of_its_calls_and_primary_follows_priority() -> None:
    calls = [
        ("execute_bash", json.dumps({"command": "ls"})),
        ("execute_bash", json.dumps({"command": "python3 a.py"})),
        ("submit", "{}"),
    ]
    labels = label_turn(calls)
    assert labels == {F, C}
    assert primary_label(labels) == C
    assert primary_label({F, E, C}) == E
    assert primary_label(set()) == "none"


def test_rules_table_is_documented() -> None:
    rows = rules_table()
    assert len(rows) == len(RULES)
    assert all(r["why"] and r["pattern"] and r["capability"] in (C, F, E, "none") for r in rows)
    # every capability has at least one rule
    assert {r["capability"] for r in rows} == {C, F, E, "none"}
