"""The embedded server's max_tokens bound (the cancellation is tested with the real
model in test_local_model.py)."""

from __future__ import annotations

import json

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
