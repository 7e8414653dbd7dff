"""The tools' schemas as the model is offered them (OpenAI function tools): data only.

Kept apart from their implementations (tasks/tools.py, which re-exports them) so that the
reader of model replies (tasks/replies.py) can type a call's parameters without importing
the tools themselves.
"""

from __future__ import annotations

from typing import Any

EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


EXECUTE_BASH = _fn(
    "execute_bash",
    "Run a bash command in the sandbox's persistent shell (working directory and exported "
    "variables persist between calls). Returns stdout, stderr and the exit code; long "
    "output is clipped in the middle.",
    {
        "command": {
            "type": "string",
            "description": "The command to run, e.g. `python solve.py` or `ls -la /testbed`.",
        }
    },
    ["command"],
)

STR_REPLACE_EDITOR = _fn(
    "str_replace_editor",
    "View, create and edit files in the sandbox.\n"
    "* `view` on a file shows it with line numbers (`cat -n`), optionally only `view_range`; "
    "on a directory it lists non-hidden entries up to 2 levels deep.\n"
    "* `create` writes `file_text` to a new file; it refuses a path that already exists.\n"
    "* `str_replace` replaces `old_str` with `new_str`; `old_str` must match exactly one "
    "place in the file, whitespace included.\n"
    "* `insert` inserts `new_str` after line `insert_line` (0 = at the top).\n"
    "* `undo_edit` reverts the last edit made to `path`.\n"
    "Long output is clipped and marked with <response clipped>.",
    {
        "command": {
            "type": "string",
            "enum": list(EDITOR_COMMANDS),
            "description": "One of `view`, `create`, `str_replace`, `insert`, `undo_edit`.",
        },
        "path": {
            "type": "string",
            "description": "Absolute path to a file or directory, e.g. `/testbed/solve.py`.",
        },
        "file_text": {
            "type": "string",
            "description": "Required for `create`: the file's content.",
        },
        "old_str": {
            "type": "string",
            "description": "Required for `str_replace`: the exact text to replace.",
        },
        "new_str": {
            "type": "string",
            "description": "For `str_replace`: the replacement (default empty). Required for `insert`.",
        },
        "insert_line": {
            "type": "integer",
            "description": "Required for `insert`: `new_str` goes after this line (0 = top).",
        },
        "view_range": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "Optional for `view` of a file: [start, end], 1-based, inclusive; "
            "end -1 means to the end of the file.",
        },
    },
    ["command", "path"],
)

SUBMIT = _fn(
    "submit",
    "Finish the task. Call it once the answer is written to the output directory.",
    {},
    [],
)

SUBMIT_ANSWER = _fn(
    "submit",
    "Finish the task. Give the final answer as `answer`; without it, the answer file in the "
    "output directory is read.",
    {"answer": {"type": "string", "description": "The final answer, e.g. `B` or `42`."}},
    [],
)

TOOL_SCHEMAS: list[dict] = [EXECUTE_BASH, STR_REPLACE_EDITOR, SUBMIT]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOL_SCHEMAS)

# The small set: the same tools and parameters in a third of the tokens, with examples that
# point at the task's own files (a 135M policy copies a description's example command:
# with the paper's, trained and benchmarked rollouts ran `cat /testbed/solve.py`).
SMALL_TOOLS: list[dict] = [
    _fn("execute_bash", "Run a bash command in the sandbox; returns its output and exit code.",
        {"command": {"type": "string", "description": "The command, e.g. `ls /testbed/documents`."}},
        ["command"]),
    _fn("str_replace_editor", "View, create or edit a file.",
        {"command": {"type": "string", "enum": list(EDITOR_COMMANDS)},
         "path": {"type": "string", "description": "Absolute path."},
         "file_text": {"type": "string", "description": "For create."},
         "old_str": {"type": "string", "description": "For str_replace: the text to replace."},
         "new_str": {"type": "string", "description": "For str_replace and insert."},
         "insert_line": {"type": "integer", "description": "For insert: after this line."},
         "view_range": {"type": "array", "items": {"type": "integer"}, "description": "For view: [start, end]."}},
        ["command", "path"]),
    SUBMIT_ANSWER,
]

TOOL_SETS: dict[str, list[dict]] = {"sandflow": TOOL_SCHEMAS, "small": SMALL_TOOLS}
"""The tool contracts a prompt set can offer (its `tools:` key, tasks/prompts.py): the
paper's (`submit` ends the task; the answer is the answer file), or `small`: the same three
tools and parameters, described in a third of the tokens, with `submit(answer)`, which
small policies use (training and benchmarking a policy offer it the same set:
docs/train.md). The same implementations either way."""
DEFAULT_TOOL_SET = "sandflow"


def tool_schemas(tool_set: str | None = None) -> list[dict]:
    """The schemas of `tool_set` (None: the default), as offered to the model."""
    name = tool_set or DEFAULT_TOOL_SET
    if name not in TOOL_SETS:
        raise ValueError(f"tools {name!r} is not a tool set (use one of {', '.join(TOOL_SETS)})")
    return TOOL_SETS[name]


def submit_takes_answer(tools: list[dict]) -> bool:
    """Whether `tools`' submit takes the answer as its `answer` argument (else the
    answer is the answer file)."""
    return any(t["function"]["name"] == "submit" and "answer" in t["function"]["parameters"]["properties"]
               for t in tools)
