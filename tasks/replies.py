"""THE reader of model replies: what a model endpoint or a policy said, as the loop's values.

Everything a reply carries is data, not truth: a server (or a proxy in front of it), a
trainer's parser and the model itself may send anything. One module reads all of it, with
one rule for what is malformed, so the agent loop (tasks/model.py, tasks/loop.py), the RL
environment (rl/, through rl/toolcalls.py), the tools (tasks/tools.py), the exports
(interop/) and the analysis (analysis/) read tool calls and usage the same way:

- **Tool calls from an OpenAI message** (`message_calls`): each entry that is an object is
  a call the model made, and every call is kept and answered. Its function is
  ``entry["function"]`` or, flat, the entry itself; a name that is not a string becomes
  ``""`` (the tool answers "Unknown tool"); arguments become text (`arguments_text`). What
  is not a call at all (``tool_calls`` not a list, an entry that is not an object) is the
  sender's shape, not the model's output: a server's reply reads it as no call
  (`strict=False`), an action handed in by a trainer is refused (`strict=True`:
  `ActionError`).
- **Tool calls in raw generated text** (`parse_text_tool_calls`): Hermes/Qwen
  ``<tool_call>`` blocks (and Qwen3-Coder's XML inside them), Mistral's ``[TOOL_CALLS]``,
  Llama 3's bare JSON object (``FORMATS``). A block that is not valid JSON still becomes
  a call (its name when readable, its raw text as the arguments).
- **Arguments to text** (`arguments_text`): a string as it is (even invalid JSON); a
  missing value (null) is ``"{}"``, no arguments; an object or list is its JSON text, unless
  it is nested deeper than ``MAX_ARGUMENT_DEPTH`` (then a text that says so, and is not JSON).
- **Arguments to a dict** (`arguments_dict`, `read_arguments`): empty text is ``{}``; text
  that is not one JSON object, or is nested deeper than ``MAX_ARGUMENT_DEPTH`` levels, is
  the model's error (`ArgumentsError`, whose message the tool gives back to the model as
  an observation). The depth is checked before the text is parsed, without recursion, so
  no arguments of any shape can raise anything else (a ``RecursionError`` from 10 KB of
  brackets was a ``sandbox_error`` and crashed every export of the run).
- **Usage** (`usage_from_openai`, `usage_from_counts`): each count is an integer in
  ``[0, MAX_TOKEN_COUNT]`` or it is unknown (None): a negative, boolean, fractional or
  absurd count (2^64) is never used, priced or stored.

`ModelReply` is what the loop consumes; `reply_from_action` makes one from a policy's turn
(the generated text, or an OpenAI assistant message); `TextReply` keeps the generated text
as the history.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.records import MAX_TOKEN_COUNT, ToolCall, Usage, bounded_count
from tasks.tool_schemas import TOOL_SETS

log = logging.getLogger(__name__)

# Tool-call arguments nested deeper than this are malformed (our tools' arguments are
# flat: depth 1; anything near Python's recursion limit, ~1000, would crash the readers).
MAX_ARGUMENT_DEPTH = 64

# An action longer than this is refused (a policy's turn is bounded by its max_tokens;
# anything near this is a caller's mistake, e.g. a whole transcript passed as one turn).
MAX_ACTION_CHARS = 4_000_000

ToolCallFormat = Literal["auto", "hermes", "mistral", "llama3_json", "none"]
FORMATS: tuple[str, ...] = ("auto", "hermes", "mistral", "llama3_json", "none")


class ActionError(ValueError):
    """The action is not a turn the environment can take (wrong type, too long...)."""


class ArgumentsError(ValueError):
    """A tool call's arguments are not one JSON object: the model's error (its message is
    what the model is told)."""


# --------------------------------------------------------------------------- counts
def token_count(value: Any) -> int | None:
    """A token count a reply reported, or None when it is not one (missing, not an
    integer, negative, or over MAX_TOKEN_COUNT): tasks.records' bound, the Usage's own."""
    return bounded_count(value)


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def usage_from_openai(u: Any) -> Usage:
    """The OpenAI usage object (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``, ``completion_tokens_details.reasoning_tokens``)
    with every count bounded; what is missing or impossible is None."""
    u = _obj(u)
    raw = {
        "prompt_tokens": u.get("prompt_tokens"),
        "completion_tokens": u.get("completion_tokens"),
        "cached_tokens": _obj(u.get("prompt_tokens_details")).get("cached_tokens"),
        "reasoning_tokens": _obj(u.get("completion_tokens_details")).get("reasoning_tokens"),
    }
    counts = {k: token_count(v) for k, v in raw.items()}
    dropped = [f"{k}={str(v)[:40]}" for k, v in raw.items() if v is not None and counts[k] is None]
    if dropped:
        log.warning(
            "the model endpoint reported %s: not a token count (0..%d), read as unknown",
            ", ".join(dropped),
            MAX_TOKEN_COUNT,
        )
    return Usage.model_construct(
        None, **counts
    )  # each value is checked here: no validation repeated


def usage_from_counts(
    u: Mapping[str, Any] | None,
    prompt_default: int | None = None,
    completion_default: int | None = None,
) -> Usage:
    """A flat mapping of the four counts (a trainer's), bounded like a server's; the
    defaults (e.g. the lengths of the token ids) fill what the mapping does not name."""
    u = dict(u or {})
    return Usage(
        prompt_tokens=token_count(u.get("prompt_tokens", prompt_default)),
        completion_tokens=token_count(u.get("completion_tokens", completion_default)),
        cached_tokens=token_count(u.get("cached_tokens")),
        reasoning_tokens=token_count(u.get("reasoning_tokens")),
    )


# --------------------------------------------------------------------------- arguments
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def text_too_deep(text: str, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Does JSON `text` nest arrays/objects deeper than `limit`? Linear, no recursion:
    strings are taken out, then the brackets are counted (a text with fewer than `limit`
    opening brackets cannot be, and is not scanned)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def value_too_deep(value: Any, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Does a decoded JSON value (dicts and lists) nest deeper than `limit`? Iterative."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return False


def _too_deep_note(limit: int = MAX_ARGUMENT_DEPTH) -> str:
    return f"<arguments nested deeper than {limit} levels: not kept>"


def arguments_text(value: Any) -> str:
    """A tool call's arguments as text: a string as it is (even invalid JSON), null as
    "{}" (no arguments), an object or list (some servers send one) as its JSON text, one
    nested deeper than MAX_ARGUMENT_DEPTH as a note saying so (not JSON: the tool answers
    that the arguments are malformed)."""
    if isinstance(value, str):
        return value
    if value is None:
        return "{}"
    if value_too_deep(value):
        return _too_deep_note()
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return str(value)[:10_000]


def arguments_dict(text: str | None, tool: str = "the tool") -> dict[str, Any]:
    """A call's arguments (its raw text) as a dict; ArgumentsError, with a message the
    model can act on, when they are not one JSON object of at most MAX_ARGUMENT_DEPTH
    levels. Empty text is no arguments ({})."""
    raw = text.strip() if text else ""
    if raw == "":
        return {}
    if text_too_deep(raw) or raw == _too_deep_note():  # the note: an object sent too deep
        raise ArgumentsError(
            f"Invalid JSON in the arguments of {tool}: nested deeper than "
            f"{MAX_ARGUMENT_DEPTH} levels. Send the arguments as one flat JSON object, "
            'e.g. {"command": "ls"}.'
        )
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ArgumentsError(
            f"Invalid JSON in the arguments of {tool}: {exc.msg} at position {exc.pos}. "
            'Send the arguments as one JSON object, e.g. {"command": "ls"}.'
        ) from None
    except (ValueError, RecursionError) as exc:  # not reached after the depth check
        raise ArgumentsError(f"Invalid JSON in the arguments of {tool}: {exc}") from None
    if not isinstance(args, dict):
        raise ArgumentsError(
            f"Invalid JSON in the arguments of {tool}: expected an object, got {type(args).__name__}."
        )
    return args


def read_arguments(text: str | None) -> tuple[dict[str, Any], str | None]:
    """(arguments, None), or ({}, why) when they are malformed: for readers of a recorded
    run (exports, analysis, display), which keep the raw text beside it."""
    raw = text.strip() if isinstance(text, str) else ""
    if raw == "":
        return {}, None
    if text_too_deep(raw) or raw == _too_deep_note():
        return {}, f"JSON nested deeper than {MAX_ARGUMENT_DEPTH} levels"
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}, "invalid JSON"
    if not isinstance(value, dict):
        return {}, f"JSON {type(value).__name__}, not an object"
    return value, None


# --------------------------------------------------------------------------- the reply
@dataclass
class ModelReply:
    """One assistant message plus what the server said about producing it."""

    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None
    finish_reason: str | None
    usage: Usage
    latency_s: float
    attempts: int = 1
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    max_tokens_used: int = 0
    raw_extra: dict[str, Any] = field(default_factory=dict)

    def as_message(self) -> dict[str, Any]:
        """The assistant message as it goes back into the history (OpenAI wire format).

        A tool-call-only reply is sent back with content "" rather than null: llama.cpp's
        server rejects a null content, and every other server treats both alike.
        """
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        return msg


@dataclass
class TextReply(ModelReply):
    """A reply whose tool calls were read out of its text: the history keeps the text."""

    def as_message(self) -> dict[str, Any]:
        return {"role": "assistant", "content": self.content or ""}


def message_calls(calls: Any, id_prefix: str = "call_", *, strict: bool = False) -> list[ToolCall]:
    """The tool calls of an OpenAI assistant message's ``tool_calls`` (the module's rule):
    every object entry is a call, kept and answered; `strict`: what is not a call at all
    raises ActionError, else it is read as no call."""
    if calls is None:
        return []
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        if strict:
            raise ActionError("the action's tool_calls must be a list of tool calls")
        return []
    out = []
    for i, c in enumerate(calls):
        if not isinstance(c, Mapping):
            if strict:
                raise ActionError(f"tool_calls[{i}] must be an object, got {type(c).__name__}")
            continue
        inner = c.get("function")
        fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else c
        name = fn.get("name")
        call_id = c.get("id")
        out.append(
            ToolCall(
                id=call_id if isinstance(call_id, str) and call_id else f"{id_prefix}{i}",
                name=name if isinstance(name, str) else "",
                arguments=arguments_text(fn.get("arguments")),
            )
        )
    return out


# --------------------------------------------------------------------------- raw text
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,200})"')
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"

# Parameter types of our tools, so XML values (always text) become the right JSON type.
_PARAM_TYPES: dict[str, dict[str, str]] = {}
for _t in (t for tools in TOOL_SETS.values() for t in tools):
    _PARAM_TYPES.setdefault(_t["function"]["name"], {}).update(
        {k: str(v.get("type", "string")) for k, v in _t["function"]["parameters"]["properties"].items()}
    )


def parse_text_tool_calls(
    text: str, fmt: ToolCallFormat = "auto", id_prefix: str = "call_"
) -> list[ToolCall]:
    """Tool calls in generated `text`, in order, ids `<id_prefix><n>`; [] when there are none.

    - ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
      (several per turn; an unterminated last block is read too, since a stop string may
      have cut ``</tool_call>`` off); inside the tags, Qwen3-Coder's
      ``<function=NAME><parameter=P>value</parameter></function>`` as well.
    - ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
    - ``llama3_json``: the whole message is one JSON object ``{"name": ..., "parameters":
      {...}}`` (optionally after ``<|python_tag|>``).
    - ``auto``: the first of these that finds a call.
    """
    if fmt == "none" or not text:
        return []
    if fmt not in FORMATS:
        raise ActionError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")
    body = _THINK.sub("", text)  # a call drafted inside the reasoning is not made
    if "</think>" in body:  # the opening tag was in the prompt (Qwen3 thinking templates)
        body = body.rsplit("</think>", 1)[1]
    raw: list[tuple[str, str]] = []
    if fmt in ("auto", "hermes"):
        raw = _hermes(body)
    if not raw and fmt in ("auto", "mistral"):
        raw = _mistral(body)
    if not raw and fmt in ("auto", "llama3_json"):
        raw = _llama3_json(body)
    return [ToolCall(id=f"{id_prefix}{i}", name=n, arguments=a) for i, (n, a) in enumerate(raw)]


def _loads(text: str) -> Any:
    """json.loads for a whole block of generated text, within the depth bound
    (ValueError beyond it, as for any text that is not JSON)."""
    if text_too_deep(text):
        raise ValueError(f"nested deeper than {MAX_ARGUMENT_DEPTH} levels")
    return json.loads(text)


def _from_json_object(obj: Any, raw: str) -> tuple[str, str]:
    if not isinstance(obj, dict):
        return _unreadable(raw)
    name = obj.get("name")
    if not isinstance(name, str):
        fn = obj.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(fn, dict) and "arguments" in fn:
            obj = fn
    args = obj.get("arguments", obj.get("parameters", {}))
    return (name if isinstance(name, str) else ""), arguments_text(args)


def _unreadable(raw: str) -> tuple[str, str]:
    """A call that is not valid JSON: its name if readable, the text as (invalid) arguments."""
    m = _NAME.search(raw)
    return (m.group(1) if m else "invalid_tool_call"), raw.strip()


def _hermes(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for m in _HERMES.finditer(text):
        block = m.group(1).strip()
        if not block:
            continue
        xml = _XML_FUNCTION.search(block)
        if xml is not None:
            out.append(_xml_call(xml.group(1), xml.group(2)))
            continue
        try:
            out.append(_from_json_object(_loads(block), block))
        except ValueError:
            out.append(_unreadable(block))
    return out


def _xml_call(name: str, body: str) -> tuple[str, str]:
    """Qwen3-Coder's form; values are text, typed by our tools' schemas."""
    types = _PARAM_TYPES.get(name, {})
    args: dict[str, Any] = {}
    for p in _XML_PARAM.finditer(body):
        key, value = p.group(1), p.group(2)
        if value.startswith("\n"):  # the template puts each value on its own lines
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        kind = types.get(key, "string")
        if kind != "string":
            try:
                args[key] = _loads(value)
                continue
            except ValueError:
                pass  # the tool will say the value has the wrong type
        args[key] = value
    return name, json.dumps(args, ensure_ascii=False)


def _mistral(text: str) -> list[tuple[str, str]]:
    at = text.find(_MISTRAL)
    if at == -1:
        return []
    payload = text[at + len(_MISTRAL) :].strip()
    try:
        data = _loads(payload)
    except ValueError:
        return [_unreadable(payload)]
    items = data if isinstance(data, list) else [data]
    return [_from_json_object(item, arguments_text(item)) for item in items]


def _llama3_json(text: str) -> list[tuple[str, str]]:
    payload = text.strip()
    if payload.startswith(_PYTHON_TAG):
        payload = payload[len(_PYTHON_TAG) :].strip()
    if not (payload.startswith("{") and payload.endswith("}")):
        return []
    try:
        obj = _loads(payload)
    except ValueError:
        return []  # prose that happens to be braces: not a call
    if (
        not isinstance(obj, dict)
        or "name" not in obj
        or not ("parameters" in obj or "arguments" in obj)
    ):
        return []
    return [_from_json_object(obj, payload)]


# --------------------------------------------------------------------------- a policy's turn
def reply_from_action(
    action: str | Mapping[str, Any],
    *,
    fmt: ToolCallFormat = "auto",
    id_prefix: str = "call_",
    prompt_token_ids: Sequence[int] | None = None,
    completion_token_ids: Sequence[int] | None = None,
    logprobs: Sequence[float] | None = None,
    usage: Mapping[str, Any] | None = None,
    finish_reason: str | None = None,
) -> ModelReply:
    """The loop's ModelReply for one policy turn.

    `action` is the generated text (tool calls read from it with `fmt`) or an OpenAI
    assistant message (``content``, ``tool_calls`` with ``function.name/arguments``,
    optional ``reasoning_content``); a message without ``tool_calls`` has its content read
    like text. Token ids and logprobs, when the trainer has them, are recorded exactly.
    """
    if isinstance(action, str):
        text, calls_in, reasoning = action, None, None
    elif isinstance(action, Mapping):
        role = action.get("role", "assistant")
        if role != "assistant":
            raise ActionError(
                f"the action message has role {role!r}; the policy speaks as 'assistant'"
            )
        content = action.get("content")
        if content is not None and not isinstance(content, str):
            raise ActionError(
                f"the action's content must be a string or null, got {type(content).__name__}"
            )
        text, calls_in = content or "", action.get("tool_calls")
        reasoning = action.get("reasoning_content") or action.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            reasoning = str(reasoning)
    else:
        raise ActionError(
            f"an action is the generated text (str) or an assistant message (dict), not {type(action).__name__}"
        )
    if len(text) > MAX_ACTION_CHARS:
        raise ActionError(
            f"the action has {len(text)} characters, over the limit of {MAX_ACTION_CHARS}: "
            "pass one assistant turn, not a transcript"
        )
    if calls_in:
        calls = message_calls(calls_in, id_prefix, strict=True)
        reply: ModelReply = ModelReply(
            content=text or None,
            tool_calls=calls,
            reasoning_content=reasoning,
            finish_reason=finish_reason or "tool_calls",
            usage=Usage(),
            latency_s=0.0,
        )
    else:
        calls = parse_text_tool_calls(text, fmt, id_prefix)
        think = _THINK.search(text)
        reply = TextReply(
            content=text,
            tool_calls=calls,
            reasoning_content=reasoning or (think.group(1).strip() if think else None),
            finish_reason=finish_reason or ("tool_calls" if calls else "stop"),
            usage=Usage(),
            latency_s=0.0,
        )
    _attach_tokens(reply, prompt_token_ids, completion_token_ids, logprobs, usage)
    return reply


def _attach_tokens(
    reply: ModelReply,
    prompt_ids: Sequence[int] | None,
    completion_ids: Sequence[int] | None,
    logprobs: Sequence[float] | None,
    usage: Mapping[str, Any] | None,
) -> None:
    if completion_ids is not None and logprobs is not None and len(logprobs) != len(completion_ids):
        raise ActionError(
            f"{len(logprobs)} logprobs for {len(completion_ids)} completion token ids: "
            "one logprob per generated token"
        )
    reply.prompt_token_ids = [int(i) for i in prompt_ids] if prompt_ids is not None else None
    reply.completion_token_ids = (
        [int(i) for i in completion_ids] if completion_ids is not None else None
    )
    reply.completion_logprobs = [float(x) for x in logprobs] if logprobs is not None else None
    reply.usage = usage_from_counts(
        usage,
        len(prompt_ids) if prompt_ids is not None else None,
        len(completion_ids) if completion_ids is not None else None,
    )
