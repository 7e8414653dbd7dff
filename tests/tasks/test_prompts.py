"""Prompt templates as data: domain overlays, user folders, safe formatting."""

from __future__ import annotations

from pathlib import Path

import pytest

from datasets_prep.task import Task
from tasks.prompts import domains, load_prompts


def test_domains_overlay_general() -> None:
    assert {"math", "chem", "long_context", "instruct_follow"} <= set(domains())
    math, general = load_prompts("math"), load_prompts("general")
    assert math.values["system"] == general.values["system"]  # inherited
    assert math.values["llm_instance"] != general.values["llm_instance"]  # overridden
    assert load_prompts("no-such-domain").values == general.values
    assert general.answer_path == "/testbed/output/answer.txt"


def test_braces_in_problems_are_safe_and_dirs_are_named() -> None:
    task = Task(id="b", domain="math", problem_statement="Let f(x)={x^2} and {0}.", ground_truth="1",
                input_files={"a.txt": "x"})
    system, user = load_prompts("math").sandbox_messages(task)
    assert "/testbed/documents" in system["content"] and "/testbed/output" in system["content"]
    assert "Let f(x)={x^2} and {0}." in user["content"]
    assert "/testbed/documents/a.txt" in user["content"]
    llm_user = load_prompts("math").llm_messages(task)[1]["content"]
    assert '<document name="a.txt">\nx\n</document>' in llm_user and "\\boxed{}" in llm_user


def test_user_prompt_folder_and_broken_template(tmp_path: Path) -> None:
    (tmp_path / "math.yaml").write_text("instance: 'Solve: {problem_statement} -> {output_dir}'\n")
    ps = load_prompts("math", str(tmp_path))
    task = Task(id="c", domain="math", problem_statement="1+1", ground_truth="2")
    assert ps.sandbox_messages(task)[1]["content"] == "Solve: 1+1 -> /testbed/output"
    (tmp_path / "chem.yaml").write_text("instance: 'oops {nonexistent}'\n")
    with pytest.raises(ValueError, match="prompt template 'instance' of domain 'chem' is broken"):
        load_prompts("chem", str(tmp_path)).sandbox_messages(task)
    (tmp_path / "biomed.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_prompts("biomed", str(tmp_path))


def test_a_prompt_set_names_its_tools_once_for_every_domain(tmp_path: Path) -> None:
    from tasks.prompts import PROMPT_SETS, resolve_prompts
    from tasks.tool_schemas import tool_schemas

    assert load_prompts("math").tool_set == "sandflow" and load_prompts("math").tools == tool_schemas()
    small = resolve_prompts("small")
    assert small == str(PROMPT_SETS["small"]) and resolve_prompts("sandflow") is None
    assert load_prompts("chem", small).tool_set == "small"

    base = (PROMPT_SETS["small"] / "general.yaml").read_text()
    (tmp_path / "general.yaml").write_text(base.replace("tools: small", "tools: answer-please"))
    with pytest.raises(ValueError, match=r"tools 'answer-please' is not a tool set \(use one of sandflow, small\)"):
        load_prompts("general", str(tmp_path))
    (tmp_path / "general.yaml").write_text(base)
    (tmp_path / "math.yaml").write_text("tools: sandflow\n")
    with pytest.raises(ValueError, match=r"math.yaml sets `tools`: the tool set is the folder's"):
        load_prompts("math", str(tmp_path))
    with pytest.raises(ValueError, match=r"the prompt folder .*nowhere has no general.yaml"):
        resolve_prompts(str(tmp_path / "nowhere"))
