"""A recorded episode's conversation: turns -> chat messages (with the tools list) -> loss mask.

THE rule every reader of a trajectory uses (the replay's prefix, the RL and SFT rows,
the ATIF, Inspect and Hugging Face exports: analysis/trajectory.py reads it for the
rows, docs/rl.md "The trajectory contract"). It lives here, beside the loop, because the replay
(tasks/replay.py) rebuilds the loop's history with it and is below analysis/.

One turn (one model call) becomes, in this order (`turn_parts`):

1. the assistant message: its text ("" when it only called tools), its reasoning, its
   tool calls (id, name, the raw argument text as the model wrote it);
2. one tool message per tool call, in call order, each answering its call's id, refused
   calls included (the loop answers every call, tasks.loop);
3. the messages the loop appended after the assistant's (`TurnRecord.extra_messages`:
   the nudge to use a tool).

The loop only nudges a reply without a tool call, so today 2 and 3 never meet; when they
do, the tool results come first: an OpenAI-style endpoint and the chat templates require
a tool message right after the assistant message whose call it answers.

Two shapes of the same messages:

- the row shape (`episode_messages`): every message has the same six keys (role,
  content, reasoning_content, tool_calls, tool_call_id, name): the struct the RL rows and
  the Hugging Face export store (analysis.trajectory.MESSAGE);
- the wire shape (`wire=True`): what the loop sent to the endpoint (tasks.replies'
  ModelReply.as_message for the assistant: no reasoning, `tool_calls` only when there
  are calls; a tool message is role, tool_call_id, content; prompt and appended messages
  as recorded). The replay continues from it, so its prefix is the parent's.

A reply whose tool calls were read from its text (rl's text tool-call format) went out
as its text alone; its record keeps the calls, so its rebuilt assistant message carries
them: a live episode's own history (EpisodeResult.messages) is the exact one.

The loss mask: 1 for what the policy wrote (assistant), 0 for everything it was given.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from tasks.records import EpisodeRecord, Observation, TurnRecord
from tasks.replies import ModelReply
from tasks.tool_schemas import tool_schemas

Part = Literal["assistant", "tool", "appended"]


def tools_of(
    mode: str, config: Mapping[str, Any] | None = None, *, episode_id: str | None = None
) -> list[dict[str, Any]]:
    """The tools an episode of `mode` was offered (OpenAI function schemas): the three of
    its prompt set's tool set in sandbox mode (the record's `config["tools"]`, default the
    paper's), none in LLM mode. A set this version does not know is a ValueError that
    names `episode_id`."""
    if mode != "sandbox":
        return []
    try:
        return [dict(t) for t in tool_schemas((config or {}).get("tools"))]
    except ValueError as exc:
        if episode_id is None:
            raise
        raise ValueError(f"episode {episode_id}: config.tools: {exc}") from None


def turn_parts(turn: TurnRecord) -> Iterator[tuple[Part, Any]]:
    """THE order of one turn's messages: ("assistant", the turn), ("tool", Observation)
    per call, ("appended", message dict) per appended message. Every format that maps a
    turn message by message walks this."""
    yield "assistant", turn
    for o in turn.observations:
        yield "tool", o
    for m in turn.extra_messages:
        yield "appended", m


def _assistant(turn: TurnRecord, wire: bool) -> dict[str, Any]:
    sent = ModelReply(turn.assistant_content, list(turn.tool_calls), turn.reasoning_content,
                      turn.finish_reason, turn.usage, 0.0).as_message()  # the loop's own rule
    if wire:
        return sent
    return {"role": "assistant", "content": sent["content"], "reasoning_content": turn.reasoning_content,
            "tool_calls": sent.get("tool_calls", []), "tool_call_id": None, "name": None}  # fmt: skip


def _tool(o: Observation, wire: bool) -> dict[str, Any]:
    if wire:  # as the loop appended it
        return {"role": "tool", "tool_call_id": o.tool_call_id, "content": o.content}
    return {"role": "tool", "content": o.content, "reasoning_content": None, "tool_calls": [],
            "tool_call_id": o.tool_call_id, "name": o.name}  # fmt: skip


def row_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """Any recorded message (a prompt's, an appended one) in the row shape: content as
    text (a list of parts or other JSON becomes its JSON text), tool calls as structs."""
    content = m.get("content")
    if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False) if content is not None else ""
    calls = m.get("tool_calls")
    return {
        "role": str(m.get("role", "user")),
        "content": content,
        "reasoning_content": m.get("reasoning_content"),
        "tool_calls": [
            {
                "id": c.get("id"),
                "type": c.get("type", "function"),
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": (c.get("function") or {}).get("arguments"),
                },
            }
            for c in (calls if isinstance(calls, list) else [])
            if isinstance(c, Mapping)
        ],
        "tool_call_id": m.get("tool_call_id"),
        "name": m.get("name"),
    }


def turn_messages(turn: TurnRecord, *, wire: bool = False) -> list[dict[str, Any]]:
    """The messages one turn appended to the history, in `turn_parts` order."""
    out = []
    for part, item in turn_parts(turn):
        if part == "assistant":
            out.append(_assistant(item, wire))
        elif part == "tool":
            out.append(_tool(item, wire))
        else:
            out.append(dict(item) if wire else row_message(item))
    return out


def episode_messages(
    episode: EpisodeRecord, turns: Sequence[TurnRecord], *, wire: bool = False
) -> list[dict[str, Any]]:
    """The whole conversation: the prompt messages (system, first user message), then
    each turn's messages, in turn order as given."""
    msgs = [dict(m) if wire else row_message(m) for m in episode.prompt_messages]
    for t in turns:
        msgs.extend(turn_messages(t, wire=wire))
    return msgs


def loss_mask(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """One 0/1 per message: train on what the policy wrote (assistant), never on what it
    was given (system, user, tool)."""
    return [1 if m.get("role") == "assistant" else 0 for m in messages]
