"""Prompt templates as data: tasks/prompt_templates/<domain>.yaml over general.yaml.

Each domain file overrides only the keys it needs. Templates are `str.format`
strings; the values substituted (problem text, documents) are never re-parsed, so
braces in a problem are safe. Users can point `prompt_dir` at their own folder
with the same file names to change prompts without touching code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from datasets_prep.task import Task
from tasks.tool_schemas import DEFAULT_TOOL_SET, tool_schemas

PROMPT_DIR = Path(__file__).with_name("prompt_templates")
PROMPT_SETS: dict[str, Path | None] = {
    "sandflow": None,  # PROMPT_DIR: the paper's prompts and tools
    "small": Path(__file__).with_name("prompt_sets") / "small",
}
"""Prompt sets by name (`--prompts NAME`); anything else given is a folder."""
REQUIRED = ("system", "instance", "llm_system", "llm_instance", "continue")


@dataclass(frozen=True)
class PromptSet:
    """One domain's templates and sandbox paths."""

    domain: str
    values: dict[str, Any]

    @property
    def working_dir(self) -> str:
        return str(self.values["working_dir"])

    @property
    def input_dir(self) -> str:
        return str(self.values["input_dir"])

    @property
    def output_dir(self) -> str:
        return str(self.values["output_dir"])

    @property
    def answer_path(self) -> str:
        return f"{self.output_dir.rstrip('/')}/{self.values['answer_file']}"

    @property
    def tool_set(self) -> str:
        """The tools this prompt set offers (tasks/tool_schemas.TOOL_SETS): its folder's
        `tools:` key, default the paper's three."""
        return str(self.values.get("tools") or DEFAULT_TOOL_SET)

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The schemas of `tool_set`, as a sandbox episode offers them."""
        return tool_schemas(self.tool_set)

    @property
    def llm_answer(self) -> str:
        """How LLM mode takes the answer from the reply: 'auto' or 'whole'."""
        return str(self.values.get("llm_answer", "auto"))

    def _fmt(self, key: str, **kw: Any) -> str:
        fields = {k: v for k, v in self.values.items() if isinstance(v, (str, int, float))}
        fields.update(kw)
        try:
            return str(self.values[key]).format(**fields)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"prompt template {key!r} of domain {self.domain!r} is broken: {exc!r} "
                "(use {{ }} for literal braces)"
            ) from None

    def sandbox_messages(self, task: Task) -> list[dict[str, str]]:
        listing = ""
        if task.input_files:
            names = ", ".join(f"{self.input_dir}/{n}" for n in sorted(task.input_files))
            listing = f"\nInput files: {names}\n"
        return [
            {"role": "system", "content": self._fmt("system")},
            {
                "role": "user",
                "content": self._fmt(
                    "instance", problem_statement=task.problem_statement, input_listing=listing
                ),
            },
        ]

    def llm_messages(self, task: Task) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self._fmt("llm_system")},
            {
                "role": "user",
                "content": self._fmt(
                    "llm_instance",
                    problem_statement=task.problem_statement,
                    documents=inline_documents(task.input_files),
                ),
            },
        ]

    def continue_message(self) -> dict[str, str]:
        return {"role": "user", "content": self._fmt("continue")}


def inline_documents(files: dict[str, str | bytes]) -> str:
    """Documents in the prompt for LLM mode, each tagged with its name."""
    parts = []
    for name in sorted(files):
        data = files[name]
        if isinstance(data, bytes):
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError:
                data = f"[binary file, {len(data)} bytes, not shown]"
        parts.append(f'<document name="{name}">\n{data}\n</document>\n\n')
    return "".join(parts)


def resolve_prompts(prompts: str | Path | None) -> str | None:
    """The prompt folder of `--prompts`: a set's name (PROMPT_SETS), or a folder holding a
    general.yaml; None for sandflow's own. A wrong value: ValueError naming it."""
    if prompts is None:
        return None
    if str(prompts) in PROMPT_SETS:
        found = PROMPT_SETS[str(prompts)]
        return None if found is None else str(found)
    path = Path(prompts).expanduser()
    if not (path / "general.yaml").is_file():
        raise ValueError(
            f"the prompt folder {path} has no general.yaml (give {', '.join(repr(n) for n in PROMPT_SETS)} or a folder)"
        )
    return str(path)


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"prompt file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"prompt file {path} must be a mapping of template names to text")
    return data


@lru_cache(maxsize=64)
def load_prompts(domain: str = "general", prompt_dir: str | None = None) -> PromptSet:
    """The templates for `domain` (general.yaml overlaid with <domain>.yaml if it exists)."""
    root = Path(prompt_dir) if prompt_dir else PROMPT_DIR
    base = root / "general.yaml"
    if not base.is_file():
        base = PROMPT_DIR / "general.yaml"
    values = _load_yaml(base)
    own = root / f"{domain}.yaml"
    if domain != "general" and own.is_file():
        overlay = _load_yaml(own)
        if "tools" in overlay and overlay["tools"] != values.get("tools"):
            raise ValueError(
                f"prompt file {own} sets `tools`: the tool set is the folder's (general.yaml), "
                "so a training run and its benchmark offer every domain the same tools"
            )
        values.update(overlay)
    try:
        tool_schemas(values.get("tools"))
    except ValueError as exc:
        raise ValueError(f"prompt file {base}: {exc}") from None
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        raise ValueError(f"prompt templates for domain {domain!r} lack {missing} (in {root})")
    return PromptSet(domain=domain, values=values)


def domains() -> list[str]:
    """Domains that have their own prompt file."""
    return sorted(p.stem for p in PROMPT_DIR.glob("*.yaml") if p.stem != "general")
