"""Built-in suites: deterministic, offline, and their own ground truths verify."""

from __future__ import annotations

import pytest

from datasets_prep.suites import SUITES, UnknownSuite, build_suite
from datasets_prep.task import Task
from datasets_prep.verifiers import score

SIZES = {"smoke": None, "math": 8, "long_context": 4, "instruct": 10, "chem": 12, "physics": 9, "all": 10}


def gold_answer(t: Task) -> str:
    """What a perfect model would write, in the form the prompt asks for."""
    gt = t.ground_truth
    if isinstance(gt, dict):
        return f"{gt['value']} {gt.get('unit', '')}".strip()
    if isinstance(gt, list):
        return str(gt[0])
    if t.qa_type == "math":
        return f"The final answer is \\boxed{{{gt}}}"
    return str(gt)


@pytest.mark.parametrize("name", list(SIZES))
def test_suite_is_deterministic(name):
    a = build_suite(name, seed=3, size=SIZES[name])
    b = build_suite(name, seed=3, size=SIZES[name])
    assert a.content_hash == b.content_hash and [t.id for t in a] == [t.id for t in b]
    c = build_suite(name, seed=4, size=SIZES[name])
    assert c.content_hash != a.content_hash
    assert len(a) == (SIZES[name] or SUITES[name].default_size)


@pytest.mark.parametrize("name", ["smoke", "math", "chem", "physics", "long_context"])
def test_gold_answers_score_full(name):
    ts = build_suite(name, seed=1, size=SIZES[name])
    for t in ts:
        if t.qa_type == "instruction":
            continue
        r = score(t, gold_answer(t))
        assert r.score == 1, (t.id, t.qa_type, t.ground_truth, r.reason)


def test_wrong_answers_score_zero_on_smoke():
    for t in build_suite("smoke", seed=0):
        if t.qa_type == "instruction":
            continue
        assert score(t, "I do not know.").score == 0, t.id


def test_smoke_covers_domains_with_small_documents():
    ts = build_suite("smoke", seed=0)
    s = ts.summary()
    assert 10 <= s["count"] <= 14
    assert set(s["by_domain"]) == {"math", "chem", "physics", "instruct_follow", "long_context"}
    assert {"single_choice", "multi_choice", "numeric", "exact", "instruction"} <= set(s["by_type"])
    assert max(t.input_bytes for t in ts) < 20_000


def test_long_context_is_long_and_answers_come_from_the_files():
    ts = build_suite("long_context", seed=0, size=6)
    for t in ts:
        assert t.input_bytes > 150_000, t.id  # tens of thousands of tokens in LLM mode
        assert "/testbed/documents/" in t.problem_statement
        text = "\n".join(v for v in t.input_files.values() if isinstance(v, str))
        assert t.problem_statement.split("\n\n")[0] not in text or t.metadata["kind"] != "speaker"
        if t.metadata["kind"] == "speaker":
            line = t.problem_statement.split('"')[1]
            assert text.count(line) == 1
            before = text[: text.index(line)]
            last_heading = [ln for ln in before.splitlines() if ln.strip().endswith(".") and ln.strip()[:-1].isupper()][-1]
            assert last_heading.strip()[:-1] == t.ground_truth


def test_instruct_suite_has_only_checkable_prompts():
    from datasets_prep.verifiers.instruct import UNSUPPORTED

    ts = build_suite("instruct", seed=0, size=500)  # more than exist: all checkable ones
    assert 150 < len(ts) < 294
    assert not any(i in UNSUPPORTED for t in ts for i in t.ground_truth["instruction_id_list"])


def test_school_math_shims_work():
    from datasets_prep.suites import math

    mods = math.school_modules()
    assert len(mods) >= 15, math.SKIPPED


def test_unknown_suite_and_bad_size():
    with pytest.raises(UnknownSuite, match="built-in suites: smoke"):
        build_suite("nope")
    with pytest.raises(ValueError, match="at least 1"):
        build_suite("chem", size=0)


_HASHES = """
import json
from datasets_prep import load_taskset
from datasets_prep.suites import math
out = {n: load_taskset(n, seed=s).content_hash for n in ("smoke", "math", "chem", "physics", "instruct",
                                                         "long_context") for s in (0, 7)}
out["school, every module 6 times"] = [t.content_hash for t in math.school(3, 6 * len(math.school_modules()))]
print(json.dumps(out, sort_keys=True))
"""


def test_suites_are_the_same_task_set_in_every_process():
    """Issue #22: hash randomisation reached the generators (variable names drawn from a
    set of letters, entities shuffled out of a set, sympy's own unseeded generator), so
    `load_taskset('smoke')` was a new task set in each process. Three processes with
    different PYTHONHASHSEED values must build identical sets."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    seen = []
    for hash_seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(root)}
        proc = subprocess.run([sys.executable, "-c", _HASHES], env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert len(seen[0]["school, every module 6 times"]) >= 6 * 15
    for other in seen[1:]:
        differ = sorted(k for k in seen[0] if seen[0][k] != other[k])
        assert not differ, f"differ between processes: {differ}"
