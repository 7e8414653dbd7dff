"""Tool calls read from a policy's raw text, in the common formats."""

from __future__ import annotations

import json

import pytest

from rl.toolcalls import TextReply, parse_text_tool_calls, reply_from_action


def _pairs(text: str, fmt: str = "auto") -> list[tuple[str, dict | str]]:
    out = []
    for c in parse_text_tool_calls(text, fmt):  # type: ignore[arg-type]
        try:
            out.append((c.name, json.loads(c.arguments)))
        except json.JSONDecodeError:
            out.append((c.name, c.arguments))
    return out


def test_hermes_blocks_in_order_and_unterminated_last() -> None:
    text = (
        'Plan.\n<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>{"name": "str_replace_editor", "arguments": "{\\"command\\": \\"view\\", \\"path\\": \\"/a\\"}"}'
    )
    assert _pairs(text) == [
        ("execute_bash", {"command": "ls"}),
        ("str_replace_editor", {"command": "view", "path": "/a"}),
    ]
    calls = parse_text_tool_calls(text, "hermes", id_prefix="call_3_")
    assert [c.id for c in calls] == ["call_3_0", "call_3_1"]


def test_calls_drafted_inside_reasoning_are_not_made() -> None:
    text = '<think><tool_call>{"name": "execute_bash", "arguments": {"command": "rm -rf /"}}</tool_call></think>ok'
    assert _pairs(text) == []


def test_qwen3_coder_xml_typed_by_the_tool_schema() -> None:
    text = (
        "<tool_call>\n<function=str_replace_editor>\n<parameter=command>\ninsert\n</parameter>\n"
        "<parameter=path>\n/testbed/a.py\n</parameter>\n<parameter=insert_line>\n3\n</parameter>\n"
        "<parameter=new_str>\nx = 1\n\n</parameter>\n</function>\n</tool_call>"
    )
    assert _pairs(text) == [
        (
            "str_replace_editor",
            {"command": "insert", "path": "/testbed/a.py", "insert_line": 3, "new_str": "x = 1\n"},
        )
    ]


def test_mistral_and_llama3_json() -> None:
    assert _pairs(
        '[TOOL_CALLS][{"name": "submit", "arguments": {}}, {"name": "execute_bash", "arguments": {"command": "pwd"}}]'
    ) == [("submit", {}), ("execute_bash", {"command": "pwd"})]
    assert _pairs('<|python_tag|>{"name": "execute_bash", "parameters": {"command": "date"}}') == [
        ("execute_bash", {"command": "date"})
    ]
    assert _pairs('{"answer": 42}') == []  # JSON prose is not a call
    assert _pairs("[TOOL_CALLS] x", "hermes") == []  # only the format asked for


def test_invalid_json_still_a_call_so_the_tool_can_say_why() -> None:
    [(name, args)] = _pairs(
        '<tool_call>{"name": "execute_bash", "arguments": {"command": "ls"</tool_call>'
    )
    assert name == "execute_bash" and isinstance(args, str)
    [(name, _)] = _pairs("<tool_call>not json at all</tool_call>")
    assert name == "invalid_tool_call"


def test_reply_from_action_keeps_text_and_tokens() -> None:
    text = '<think>r</think>hi <tool_call>{"name": "submit", "arguments": {}}</tool_call>'
    reply = reply_from_action(
        text, completion_token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], prompt_token_ids=[1, 2]
    )
    assert isinstance(reply, TextReply) and reply.as_message() == {
        "role": "assistant",
        "content": text,
    }
    assert reply.reasoning_content == "r" and [c.name for c in reply.tool_calls] == ["submit"]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2, 3)
    msg = reply_from_action(
        {
            "role": "assistant",
            "content": "x",
            "tool_calls": [{"function": {"name": "execute_bash", "arguments": {"command": "ls"}}}],
        }
    )
    assert msg.as_message()["tool_calls"][0]["function"] == {
        "name": "execute_bash",
        "arguments": '{"command": "ls"}',
    }
    with pytest.raises(ValueError, match="format"):
        parse_text_tool_calls("x", "bogus")  # type: ignore[arg-type]
