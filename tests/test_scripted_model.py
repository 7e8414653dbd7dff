"""The scripted model answers `stream: true` as OpenAI streams (server-sent events), so a
consumer that streams (verifiers' chat program) reads the same reply, tool calls and usage."""

from __future__ import annotations

import json

from openai import OpenAI

from tests.scripted_model import Reply, ScriptedModel, tool_call


def test_a_streamed_reply_carries_text_tool_calls_and_usage() -> None:
    call = tool_call("execute_bash", {"command": "ls"})
    with ScriptedModel([Reply(content="looking", tool_calls=[call])]) as model:
        client = OpenAI(base_url=model.url, api_key="x")
        chunks = list(client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}],
            stream=True, stream_options={"include_usage": True},
        ))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "looking"
    [tc] = [t for d in deltas for t in (d.tool_calls or [])]
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("execute_bash", {"command": "ls"})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
