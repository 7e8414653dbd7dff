"""The embedded server's max_tokens bound (the cancellation is tested with the real
model in test_local_model.py)."""

from __future__ import annotations

import json
import re

import pytest

from tasks.local_model_app import RequestBudget, cap_body


def test_cap_body_bounds_max_tokens() -> None:
    for asked in (None, 0, -5, 10_000, "12", True, 1.5):
        body = json.dumps({"messages": [], "max_tokens": asked}).encode()
        out, capped, budget = cap_body(body, 512)
        assert capped and json.loads(out)["max_tokens"] == 512 and budget == 512, asked
    out, capped, budget = cap_body(json.dumps({"messages": []}).encode(), 512)
    assert capped and json.loads(out)["max_tokens"] == 512 and budget == 512
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 64}).encode()
    assert cap_body(body, 512) == (body, False, 64)  # within the bound: untouched, byte for byte


def test_cap_body_leaves_what_it_cannot_read_to_the_server() -> None:
    for body in (b"not json", b"[1, 2]", b"", b'"text"'):
        assert cap_body(body, 512) == (body, False, 512)


def test_the_budget_counts_every_token_of_the_request() -> None:
    budget = RequestBudget(3)
    assert [budget.stop_now() for _ in range(4)] == [False, False, False, True]  # 3 kept
    assert budget.exhausted
    other = RequestBudget(100)
    other.cancel.set()  # the client left
    assert other.stop_now() and not other.exhausted


def test_an_oversized_body_is_refused_before_it_is_buffered() -> None:
    import asyncio
    import concurrent.futures

    from tasks import local_model_app as app_mod

    sent: list[dict] = []
    called: list[bool] = []

    async def app(scope, receive, send):  # the wrapped server: must never be reached
        called.append(True)

    chunk = b"x" * (1 << 20)
    n = app_mod.MAX_BODY_BYTES // len(chunk) + 2

    async def run() -> None:
        msgs = iter([{"type": "http.request", "body": chunk, "more_body": True}] * n)

        async def receive():
            return next(msgs)

        async def send(msg):
            sent.append(msg)

        mw = app_mod.CancelOnDisconnect(app, 512)
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await mw(scope, receive, send)

    # in a thread of its own: a session's Playwright (tests/viewer) keeps an event loop
    # running in the main thread, where asyncio.run refuses to start
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()
    assert not called
    assert sent[0]["status"] == 413 and b"request body over" in sent[1]["body"]


# --------------------------------------------------------------------------- the chat engine
def test_tool_text_parses_back_to_the_text_it_came_from() -> None:
    from tasks.local_chat import ChatEngine, parse_tool_text

    names = ["execute_bash", "submit", "str_replace_editor"]
    text = 'functions.execute_bash:\n{"command": "ls\\nfunctions.submit:"}  \n\nfunctions.submit:\n{}'
    content, calls = parse_tool_text(text, names)
    assert content is None
    assert calls == [("execute_bash", '{"command": "ls\\nfunctions.submit:"}  \n'), ("submit", "{}")]
    body = ChatEngine.assistant_body(
        {"content": "", "tool_calls": [{"name": n, "arguments": a} for n, a in calls]}, True)
    assert body == text  # what goes back into the history is what was generated
    assert parse_tool_text("message:\nhello", names) == ("hello", [])
    assert ChatEngine.assistant_body({"content": "hello"}, True) == "message:\nhello"
    assert parse_tool_text("no format", names) == ("no format", [])


def _vocab():
    import llama_cpp

    from tasks.local_model import find_gguf

    return llama_cpp.Llama(model_path=str(find_gguf()), vocab_only=True, verbose=False)


@pytest.mark.model
def test_every_grammar_is_parsed_by_llama_cpp_before_sampling() -> None:
    """llama-cpp-python hands llama.cpp's grammar parse to the sampler chain unchecked: a
    grammar it rejects is a NULL sampler and the next token a SIGSEGV. The engine parses
    first: the tool grammar and each question schema's grammar parse; a broken one is a
    RequestError (a 400), a schema the converter refuses too."""
    import llama_cpp

    from datagen.questions import TYPES, json_schema
    from tasks.local_chat import RequestError, check_grammar, schema_grammar, tools_grammar
    from tasks.tools import TOOL_SCHEMAS

    vocab = _vocab()._model.vocab
    grammars = [tools_grammar(TOOL_SCHEMAS, c) for c in ("auto", "required", "submit")]
    grammars += [schema_grammar(json_schema(t)) for t in TYPES] + [schema_grammar(None)]
    for g in grammars:
        llama_cpp.llama_sampler_free(check_grammar(vocab, g))
    with pytest.raises(RequestError, match="does not parse"):
        check_grammar(vocab, 'root ::= "a" | (')
    with pytest.raises(RequestError, match="cannot become a grammar"):
        schema_grammar({"type": "string", "pattern": "^(?!ab)c$"})
    with pytest.raises(RequestError, match="over the"):
        schema_grammar({"type": "object", "description": "x" * 70_000})


def test_requests_the_engine_refuses_name_the_field() -> None:
    from tasks.local_chat import RequestError, parse_request

    ok = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(ok, 100).messages == [{"role": "user", "content": "hi"}]
    for bad, field_ in [
        ({}, "messages"),
        ({**ok, "stream": True}, "stream"),
        ({**ok, "n": 3}, "n:"),
        ({**ok, "temperature": "hot"}, "temperature"),
        ({**ok, "logit_bias": {"100": 5}}, "logit_bias"),
        ({**ok, "top_logprobs": 99}, "top_logprobs"),
        ({**ok, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({**ok, "tools": [{"function": {"name": "bad name!"}}]}, "tools[0]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({**ok, "response_format": {"type": "xml"}}, "response_format"),
    ]:
        with pytest.raises(RequestError, match=re.escape(field_)):
            parse_request(bad, 100)
