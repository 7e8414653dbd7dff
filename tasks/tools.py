"""The model's three tools: execute_bash, str_replace_editor, submit.

The schemas keep llm-in-sandbox 0.2.0's names and parameters (plus `undo_edit`), so a
model behaves the same in both tools. The implementations differ where the peer
breaks: files go through the sandbox's read_file/write_file (binary-safe, no shell
quoting, no added newline, no expandtabs rewrite), `view` works on any text file and
on directories, and every failure is an observation the model can act on. Only
`SandboxError` (broken infrastructure) escapes from here.
"""

from __future__ import annotations

import posixpath
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from sandbox.base import ExecResult, Sandbox
from tasks.records import Observation, ToolCall
from tasks.replies import ArgumentsError, arguments_dict
from tasks.tool_schemas import (  # the schemas' home; re-exported: callers import them here
    EDITOR_COMMANDS as EDITOR_COMMANDS,
)
from tasks.tool_schemas import EXECUTE_BASH as EXECUTE_BASH
from tasks.tool_schemas import STR_REPLACE_EDITOR as STR_REPLACE_EDITOR
from tasks.tool_schemas import SUBMIT as SUBMIT
from tasks.tool_schemas import TOOL_NAMES as TOOL_NAMES
from tasks.tool_schemas import TOOL_SCHEMAS as TOOL_SCHEMAS

MAX_OBSERVATION_CHARS = 16_000
SNIPPET_CONTEXT = 4


class ToolInputError(Exception):
    """The model called a tool wrongly: becomes an error observation, never an exception."""


@dataclass
class ToolResult:
    observation: Observation
    submitted: bool = False
    submit_args: dict[str, Any] = field(default_factory=dict)


def clip(text: str, limit: int = MAX_OBSERVATION_CHARS) -> tuple[str, bool]:
    """Keep head and tail of long text; say so in the text (no silent truncation)."""
    if len(text) <= limit:
        return text, False
    half = limit // 2
    dropped = len(text) - 2 * half
    return f"{text[:half]}\n<response clipped: {dropped} characters omitted>\n{text[-half:]}", True


def clip_bytes(text: str, limit: int, why: str) -> tuple[str, bool]:
    """Keep head and tail of `text` within `limit` UTF-8 bytes (the notice, naming `why`,
    comes on top); characters are never split."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text, False
    half = max(0, limit) // 2
    head = data[:half].decode("utf-8", errors="ignore")
    tail = data[len(data) - half :].decode("utf-8", errors="ignore") if half else ""
    dropped = len(data) - len(head.encode("utf-8")) - len(tail.encode("utf-8"))
    return f"{head}\n<response clipped: {dropped} bytes omitted, {why}>\n{tail}", True


def format_exec(result: ExecResult, timeout_s: float | None) -> str:
    """stdout, stderr and what happened, in one observation text."""
    parts: list[str] = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        limit = f" after {timeout_s:g}s" if timeout_s else ""
        parts.append(f"[command timed out{limit} and was killed]")
    elif result.oom_killed:
        parts.append("[command killed: out of memory]")
    if result.truncated:
        parts.append(f"[output truncated by the sandbox: {result.dropped_bytes} bytes dropped]")
    parts.append(f"[exit code: {result.exit_code}]")
    return "\n".join(parts)


def _numbered(lines: list[str], start: int) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start))


class Editor:
    """str_replace_editor over a sandbox, with a per-path undo history."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.history: dict[str, list[bytes | None]] = {}

    def run(self, args: dict[str, Any]) -> str:
        command = args.get("command")
        path = args.get("path")
        if command not in EDITOR_COMMANDS:
            raise ToolInputError(
                f"Unknown command {command!r}: use one of {', '.join(EDITOR_COMMANDS)}."
            )
        if not isinstance(path, str) or not path.startswith("/"):
            raise ToolInputError(f"`path` must be an absolute path, got {path!r}.")
        path = posixpath.normpath(path)
        return str(getattr(self, f"_{command}")(path, args))

    # -- helpers ---------------------------------------------------------------
    def _kind(self, path: str) -> str:
        q = shlex.quote(path)
        r = self.sandbox.exec(
            f"if [ -d {q} ]; then echo dir; elif [ -f {q} ]; then echo file; "
            f"elif [ -e {q} ]; then echo other; else echo missing; fi",
            timeout=30,
        )
        return r.stdout.strip() or "missing"

    def _read_text(self, path: str) -> tuple[bytes, str]:
        kind = self._kind(path)
        if kind == "missing":
            raise ToolInputError(f"The path {path} does not exist.")
        if kind == "dir":
            raise ToolInputError(f"{path} is a directory; this command needs a file.")
        data = self.sandbox.read_file(path)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolInputError(
                f"{path} is not UTF-8 text ({len(data)} bytes); inspect it with execute_bash "
                "(e.g. `file` or `xxd | head`)."
            ) from None
        return data, text

    def _write(self, path: str, old: bytes | None, new: str) -> None:
        self.sandbox.write_file(path, new.encode("utf-8"))
        self.history.setdefault(path, []).append(old)

    def _snippet(self, text: str, first_line: int, n_lines: int, path: str) -> str:
        lines = text.split("\n")
        lo = max(0, first_line - SNIPPET_CONTEXT)
        hi = min(len(lines), first_line + n_lines + SNIPPET_CONTEXT)
        return (
            f"The file {path} has been edited. Here is the result of `cat -n` on a snippet:\n"
            f"{_numbered(lines[lo:hi], lo + 1)}\n"
            "Review the changes and make sure they are as expected."
        )

    # -- commands --------------------------------------------------------------
    def _view(self, path: str, args: dict[str, Any]) -> str:
        kind = self._kind(path)
        if kind == "missing":
            raise ToolInputError(f"The path {path} does not exist.")
        view_range = args.get("view_range")
        if kind == "dir":
            if view_range:
                raise ToolInputError("`view_range` only applies to files, not directories.")
            r = self.sandbox.exec(
                f"find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' | sort", timeout=60
            )
            return (
                f"Files and directories up to 2 levels deep in {path}, excluding hidden items:\n"
                f"{r.stdout.rstrip()}"
            )
        _, text = self._read_text(path)
        lines = text.split("\n")
        if text.endswith("\n"):
            lines = lines[:-1]
        start, end = 1, len(lines)
        if view_range is not None:
            if (
                not isinstance(view_range, list)
                or len(view_range) != 2
                or not all(isinstance(v, int) for v in view_range)
            ):
                raise ToolInputError("`view_range` must be two integers [start, end].")
            start, end = view_range
            if end == -1:
                end = len(lines)
            if not 1 <= start <= max(1, len(lines)):
                raise ToolInputError(
                    f"view_range start {start} is outside the file's lines [1, {len(lines)}]."
                )
            if end < start or end > len(lines):
                raise ToolInputError(
                    f"view_range end {end} must be -1 or within [{start}, {len(lines)}]."
                )
        body = _numbered(lines[start - 1 : end], start)
        return f"Here's the result of running `cat -n` on {path}:\n{body}"

    def _create(self, path: str, args: dict[str, Any]) -> str:
        file_text = args.get("file_text")
        if not isinstance(file_text, str):
            raise ToolInputError("`file_text` is required for `create`.")
        kind = self._kind(path)
        if kind != "missing":
            raise ToolInputError(
                f"{path} already exists; edit it with `str_replace`, or overwrite it with execute_bash."
            )
        self._write(path, None, file_text)  # write_file creates the parent folders
        return f"File created successfully at: {path}"

    def _str_replace(self, path: str, args: dict[str, Any]) -> str:
        old_str = args.get("old_str")
        new_str = args.get("new_str") or ""
        if not isinstance(old_str, str) or old_str == "":
            raise ToolInputError("`old_str` is required for `str_replace` and must not be empty.")
        if not isinstance(new_str, str):
            raise ToolInputError("`new_str` must be a string.")
        data, text = self._read_text(path)
        count = text.count(old_str)
        if count == 0:
            raise ToolInputError(
                f"No replacement was performed: old_str did not appear verbatim in {path}."
            )
        if count > 1:
            lines, pos = [], text.find(old_str)
            while pos != -1:
                lines.append(text.count("\n", 0, pos) + 1)
                pos = text.find(old_str, pos + 1)
            raise ToolInputError(
                f"No replacement was performed: old_str appears {count} times in {path} "
                f"(lines {lines}). Include more context to make it unique."
            )
        at = text.find(old_str)
        new_text = text.replace(old_str, new_str, 1)
        self._write(path, data, new_text)
        first = text.count("\n", 0, at)
        return self._snippet(new_text, first, new_str.count("\n") + 1, path)

    def _insert(self, path: str, args: dict[str, Any]) -> str:
        new_str = args.get("new_str")
        line = args.get("insert_line")
        if not isinstance(new_str, str):
            raise ToolInputError("`new_str` is required for `insert`.")
        if isinstance(line, bool) or not isinstance(line, int):
            raise ToolInputError("`insert_line` (an integer) is required for `insert`.")
        data, text = self._read_text(path)
        lines = text.splitlines(keepends=True)
        if not 0 <= line <= len(lines):
            raise ToolInputError(f"insert_line {line} is outside [0, {len(lines)}] for {path}.")
        block = new_str if new_str.endswith("\n") else new_str + "\n"
        if line > 0 and not lines[line - 1].endswith("\n"):
            lines[line - 1] += "\n"  # inserting after an unterminated last line
        new_text = "".join(lines[:line]) + block + "".join(lines[line:])
        self._write(path, data, new_text)
        return self._snippet(new_text, line, new_str.count("\n") + 1, path)

    def _undo_edit(self, path: str, args: dict[str, Any]) -> str:
        stack = self.history.get(path)
        if not stack:
            raise ToolInputError(f"No edit to undo for {path}.")
        previous = stack.pop()
        if previous is None:
            self.sandbox.exec(f"rm -f {shlex.quote(path)}", timeout=30)
            return f"Undid the creation of {path}; the file is removed."
        self.sandbox.write_file(path, previous)
        return f"Last edit to {path} undone."


class ToolBox:
    """Runs the model's tool calls against one sandbox."""

    schemas = TOOL_SCHEMAS

    def __init__(self, sandbox: Sandbox, max_observation_chars: int = MAX_OBSERVATION_CHARS) -> None:
        self.sandbox = sandbox
        self.editor = Editor(sandbox)
        self.max_observation_chars = max_observation_chars

    def call(self, call: ToolCall, timeout_s: float | None = None) -> ToolResult:
        """Execute one tool call. Wrong use -> error observation; SandboxError propagates."""
        t0 = time.perf_counter()
        obs = Observation(tool_call_id=call.id, name=call.name, content="")
        result = ToolResult(observation=obs)
        try:
            args = parse_arguments(call)
            if call.name == "execute_bash":
                command = args.get("command")
                if not isinstance(command, str) or not command.strip():
                    raise ToolInputError("`command` (a non-empty string) is required.")
                r = self.sandbox.exec(command, timeout=timeout_s)
                obs.content = format_exec(r, timeout_s)
                obs.exit_code, obs.timed_out = r.exit_code, r.timed_out
                obs.oom_killed, obs.truncated = r.oom_killed, r.truncated
            elif call.name == "str_replace_editor":
                obs.content = self.editor.run(args)
            elif call.name == "submit":
                obs.content = "Submitted."
                result.submitted, result.submit_args = True, args
            else:
                raise ToolInputError(
                    f"Unknown tool {call.name!r}. Available tools: {', '.join(TOOL_NAMES)}."
                )
        except ToolInputError as exc:
            obs.error = type(exc).__name__ if not exc.args else _error_kind(str(exc))
            obs.content = f"ERROR: {exc}"
        obs.content, clipped = clip(obs.content, self.max_observation_chars)
        obs.truncated = obs.truncated or clipped
        obs.duration_s = time.perf_counter() - t0
        return result


def _error_kind(message: str) -> str:
    """A short, groupable label for the records (full text is in the observation)."""
    if message.startswith("Invalid JSON"):
        return "invalid JSON arguments"
    if message.startswith("Unknown tool"):
        return "unknown tool"
    return "tool input error"


def parse_arguments(call: ToolCall) -> dict[str, Any]:
    """The call's arguments as a dict (tasks.replies' rule), or a ToolInputError the model
    can act on: malformed arguments of any shape are the model's error, never ours."""
    try:
        return arguments_dict(call.arguments, call.name)
    except ArgumentsError as exc:
        raise ToolInputError(str(exc)) from None
