"""The policy's turn as the loop's `ModelReply`: an OpenAI message, or raw generated text.

A trainer that generates with vLLM/SGLang in token-in-token-out mode has no tool parser
in the way: it hands over the decoded text, and the tool calls are inside it in the
model's own format. Formats read here (`FORMATS`):

- ``hermes``: Hermes / Qwen2.5 / Qwen3 ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (several per turn; an unterminated last block is read too, since a stop string
  may have cut ``</tool_call>`` off). Inside the tags, Qwen3-Coder's XML form
  ``<function=NAME><parameter=P>value</parameter></function>`` is read as well.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
- ``llama3_json``: the whole message is one JSON object ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``).
- ``auto`` (default): the first of these that finds a call.

A block that is not valid JSON still becomes a tool call (its name when it can be read,
its raw text as arguments): the tool then answers "Invalid JSON ..." and the model can
correct itself, exactly as with a server-side parser that passes bad arguments through.

The text the model generated is kept as is: `TextReply.as_message()` puts the raw text
back into the history (no re-rendered tool calls), so the history is what the policy saw.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tasks.model import ModelReply
from tasks.records import ToolCall, Usage
from tasks.tools import TOOL_SCHEMAS

ToolCallFormat = Literal["auto", "hermes", "mistral", "llama3_json", "none"]
FORMATS: tuple[str, ...] = ("auto", "hermes", "mistral", "llama3_json", "none")

# An action longer than this is refused (a policy's turn is bounded by its max_tokens;
# anything near this is a caller's mistake, e.g. a whole transcript passed as one turn).
MAX_ACTION_CHARS = 4_000_000

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,200})"')
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"

# Parameter types of our tools, so XML values (always text) become the right JSON type.
_PARAM_TYPES: dict[str, dict[str, str]] = {
    t["function"]["name"]: {
        k: str(v.get("type", "string"))
        for k, v in t["function"]["parameters"]["properties"].items()
    }
    for t in TOOL_SCHEMAS
}


class ActionError(ValueError):
    """The action is not a turn the environment can take (wrong type, too long...)."""


@dataclass
class TextReply(ModelReply):
    """A reply whose tool calls were read out of its text: the history keeps the text."""

    def as_message(self) -> dict[str, Any]:
        return {"role": "assistant", "content": self.content or ""}


def parse_text_tool_calls(
    text: str, fmt: ToolCallFormat = "auto", id_prefix: str = "call_"
) -> list[ToolCall]:
    """Tool calls in `text`, in order, ids `<id_prefix><n>`; [] when there are none."""
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


def _arguments_text(args: Any) -> str:
    """Arguments as JSON text (a JSON string holding an object is taken as that object)."""
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


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
    return (name if isinstance(name, str) else ""), _arguments_text(args)


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
            out.append(_from_json_object(json.loads(block), block))
        except json.JSONDecodeError:
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
                args[key] = json.loads(value)
                continue
            except json.JSONDecodeError:
                pass  # the tool will say the value has the wrong type
        args[key] = value
    return name, json.dumps(args, ensure_ascii=False)


def _mistral(text: str) -> list[tuple[str, str]]:
    at = text.find(_MISTRAL)
    if at == -1:
        return []
    payload = text[at + len(_MISTRAL) :].strip()
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return [_unreadable(payload)]
    items = data if isinstance(data, list) else [data]
    return [_from_json_object(item, json.dumps(item)) for item in items]


def _llama3_json(text: str) -> list[tuple[str, str]]:
    payload = text.strip()
    if payload.startswith(_PYTHON_TAG):
        payload = payload[len(_PYTHON_TAG) :].strip()
    if not (payload.startswith("{") and payload.endswith("}")):
        return []
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return []  # prose that happens to be braces: not a call
    if (
        not isinstance(obj, dict)
        or "name" not in obj
        or not ("parameters" in obj or "arguments" in obj)
    ):
        return []
    return [_from_json_object(obj, payload)]


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
        calls = _message_calls(calls_in, id_prefix)
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


def _message_calls(calls: Any, id_prefix: str) -> list[ToolCall]:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ActionError("the action's tool_calls must be a list of tool calls")
    out = []
    for i, c in enumerate(calls):
        if not isinstance(c, Mapping):
            raise ActionError(f"tool_calls[{i}] must be an object, got {type(c).__name__}")
        inner = c.get("function")
        fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else c
        name = fn.get("name")
        if not isinstance(name, str):
            raise ActionError(f"tool_calls[{i}] has no function name")
        call_id = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"{id_prefix}{i}"
        out.append(ToolCall(id=call_id, name=name, arguments=_arguments_text(fn.get("arguments"))))
    return out


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
    u = dict(usage or {})
    reply.usage = Usage(
        prompt_tokens=u.get("prompt_tokens", len(prompt_ids) if prompt_ids is not None else None),
        completion_tokens=u.get(
            "completion_tokens", len(completion_ids) if completion_ids is not None else None
        ),
        cached_tokens=u.get("cached_tokens"),
        reasoning_tokens=u.get("reasoning_tokens"),
    )
