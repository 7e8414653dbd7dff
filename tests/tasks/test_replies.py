"""One reader of model replies (tasks/replies.py, issue #38 item 3): an OpenAI message
read by the model client (over real HTTP from the scripted server) and the same message
handed to the RL environment as an action give the same tool calls, with one rule for
what is malformed."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.model import ModelClient, ModelConfig
from tasks.replies import (
    MAX_ARGUMENT_DEPTH,
    ArgumentsError,
    arguments_dict,
    arguments_text,
    read_arguments,
    reply_from_action,
)
from tests.scripted_model import Reply, ScriptedModel

# Each a message's tool_calls as a model (through a server's parser) may send them.
CALLS: dict[str, list[dict[str, Any]]] = {
    "ordinary": [{"id": "a", "type": "function", "function": {"name": "execute_bash", "arguments": '{"command": "ls"}'}}],
    "null arguments": [{"id": "a", "type": "function", "function": {"name": "submit", "arguments": None}}],
    "object arguments": [{"id": "a", "type": "function", "function": {"name": "execute_bash", "arguments": {"command": "é"}}}],
    "no name": [{"id": "a", "type": "function", "function": {"arguments": "{}"}}],
    "flat": [{"id": "a", "name": "submit", "arguments": "{}"}],
    "invalid JSON": [{"id": "a", "type": "function", "function": {"name": "execute_bash", "arguments": '{"command": '}}],
    "deep object": [{"id": "a", "type": "function", "function": {"name": "execute_bash", "arguments": {"c": "DEEP"}}}],
}  # fmt: skip
_deep: Any = 1
for _ in range(70):
    _deep = [_deep]
CALLS["deep object"][0]["function"]["arguments"]["c"] = _deep  # 71 levels with its object


@pytest.mark.parametrize("name", list(CALLS))
def test_the_loop_and_the_rl_env_read_a_message_the_same_way(name: str) -> None:
    calls = CALLS[name]
    with ScriptedModel([Reply(tool_calls=calls)], models=("scripted",)) as server:
        client = ModelClient(ModelConfig(model="scripted", base_url=server.url))
        try:
            served = client.complete([{"role": "user", "content": "go"}]).tool_calls
        finally:
            client.close()
    acted = reply_from_action({"role": "assistant", "content": None, "tool_calls": calls}).tool_calls
    assert served == acted, (served, acted)
    assert len(served) == 1  # every call the model made is kept (and answered)
    call = served[0]
    if name == "null arguments":
        assert call.arguments == "{}"
    if name == "object arguments":
        assert call.arguments == '{"command": "é"}'
    if name == "no name":
        assert call.name == ""  # the tool answers "Unknown tool"
    if name == "deep object":
        with pytest.raises(ArgumentsError, match=f"nested deeper than {MAX_ARGUMENT_DEPTH} levels"):
            arguments_dict(call.arguments)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", None),
        ('{"command": "ls"}', None),
        ("[1, 2]", "JSON list, not an object"),
        ('{"command": ', "invalid JSON"),
        ("[" * 100_000, f"JSON nested deeper than {MAX_ARGUMENT_DEPTH} levels"),
        ('{"a": "' + "[" * 5000 + '"}', None),  # brackets inside a string are text
        ('{"a": ' + "[" * 64 + "]" * 64 + "}", f"JSON nested deeper than {MAX_ARGUMENT_DEPTH} levels"),
        ('{"a": ' + "[" * 63 + "]" * 63 + "}", None),
    ],
)
def test_arguments_of_any_shape_read_without_raising(text: str, problem: str | None) -> None:
    value, why = read_arguments(text)
    assert why == problem
    assert isinstance(value, dict)
    if problem is not None:
        with pytest.raises(ArgumentsError):
            arguments_dict(text, "execute_bash")


def test_an_object_too_deep_to_dump_becomes_a_note() -> None:
    nested: Any = 1
    for _ in range(5000):
        nested = [nested]
    text = arguments_text({"c": nested})
    assert "nested deeper than" in text
    assert read_arguments(text)[1] == f"JSON nested deeper than {MAX_ARGUMENT_DEPTH} levels"
