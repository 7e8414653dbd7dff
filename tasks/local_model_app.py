"""The embedded model's server process: /v1/models and /v1/chat/completions over
tasks/local_chat.py's engine, made to stop working for clients that are gone.

A server that computes a non-streamed completion to its end after the client has hung
up (llama-cpp-python's own did) makes a retry wait behind abandoned work on the same
CPU. Two bounds, both inside the server process:

- cancel on disconnect: an ASGI middleware reads the request body, then watches the
  connection; when the client leaves, the generation stops at its next token (the
  engine asks the request's budget before keeping each sampled token);
- a token budget per request: max_tokens, bounded by ``--max-tokens-cap`` (a request
  asking for more, or for no limit, gets the cap). (llama-cpp-python's
  chatml-function-calling handler generated each tool call's arguments with
  ``max_tokens=None``: a call asking for 512 tokens generated 3,068 in 190 s. The
  engine makes one generation per request, bounded.)

Run as ``python -m tasks.local_model_app --model F.gguf --max-tokens-cap N [--slots N]
[--tool-format chatml-function-calling|qwen2.5]``;
tasks/local_model.py starts it. Prompt evaluation itself is not interruptible (it is
bounded by the context size).
"""

from __future__ import annotations

import argparse
import contextvars
import json
import sys
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestBudget:
    """What one request may still do: stop when its client left or its tokens ran out."""

    def __init__(self, tokens: int) -> None:
        self.cancel = threading.Event()
        self.tokens_left = tokens
        self.exhausted = False

    def stop_now(self) -> bool:
        """Called once per sampled token, before it is kept (a stopping criterion)."""
        if self.cancel.is_set():
            return True
        self.tokens_left -= 1
        if self.tokens_left < 0:
            self.exhausted = True
            return True
        return False


# The budget of the request whose generation runs in this context (FastAPI runs the
# blocking llama call in a worker thread with a copy of the request's context).
_BUDGET: contextvars.ContextVar[RequestBudget | None] = contextvars.ContextVar(
    "sandflow_budget", default=None
)
_GENERATING_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_BODY_BYTES = 64 << 20  # far above any n_ctx worth of text: a bound, not a limit in use
stats = {"cancelled": 0, "capped": 0, "exhausted": 0}


def cap_body(body: bytes, cap: int) -> tuple[bytes, bool, int]:
    """(`body` with max_tokens bounded by `cap`, whether it changed, the request's budget).

    Absent, null, <= 0 or larger max_tokens -> cap. Anything that is not a JSON object
    is returned unchanged (the server's own validation answers it) with the cap as budget.
    """
    try:
        req = json.loads(body)
    except ValueError:
        return body, False, cap
    if not isinstance(req, dict):
        return body, False, cap
    asked = req.get("max_tokens")
    if isinstance(asked, int) and not isinstance(asked, bool) and 0 < asked <= cap:
        return body, False, asked
    req["max_tokens"] = cap
    return json.dumps(req).encode(), True, cap


class CancelOnDisconnect:
    """ASGI middleware: a token budget per request, and cancel when the client leaves."""

    def __init__(self, app: ASGIApp, max_tokens_cap: int, log: Callable[[str], None] = print):
        self.app = app
        self.cap = max_tokens_cap
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in _GENERATING_PATHS
        ):
            await self.app(scope, receive, send)
            return
        import anyio

        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # gone before it finished sending: nothing to compute
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _refuse(send, 413, f"request body over {MAX_BODY_BYTES} bytes")
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body, capped, limit = cap_body(b"".join(chunks), self.cap)
        if capped:
            stats["capped"] += 1
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"
            ] + [(b"content-length", str(len(body)).encode())]

        budget = RequestBudget(limit)
        gone = anyio.Event()
        delivered = False
        answered = False  # after the last byte of the answer, a disconnect is no news

        async def send_and_note(msg: Message) -> None:
            nonlocal answered
            await send(msg)
            if msg.get("type") == "http.response.body" and not msg.get("more_body", False):
                answered = True

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            if not gone.is_set():  # (checked first: a cancelled poll must still see it)
                await gone.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone.set()
                if not answered:
                    budget.cancel.set()

        token = _BUDGET.set(budget)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                try:
                    await self.app(scope, replay, send_and_note)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            _BUDGET.reset(token)
            if budget.cancel.is_set():
                stats["cancelled"] += 1
                self.log(f"sandflow: client left; generation stopped ({scope.get('path')})")
            elif budget.exhausted:
                stats["exhausted"] += 1
                self.log(f"sandflow: request used its {limit} tokens; generation stopped")


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _stop_now() -> bool:
    budget = _BUDGET.get()
    return budget is not None and budget.stop_now()


def _client_gone() -> bool:
    budget = _BUDGET.get()
    return budget is not None and budget.cancel.is_set()


def create_app(engine: Any, alias: str, max_tokens_cap: int, always_token_ids: bool = False) -> Any:
    """The OpenAI-compatible routes over `engine` (tasks.local_chat.ChatEngine)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tasks.local_chat import RequestError

    def error(status: int, message: str, code: str = "invalid_request_error") -> Any:
        return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status)

    async def models(request: Any) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": alias, "object": "model", "owned_by": "sandflow"}]})

    async def health(request: Any) -> Any:
        return JSONResponse({"status": "ok", "slots": len(engine.slots), "stats": engine.stats})

    async def chat(request: Any) -> Any:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "the request body is not JSON")
        if isinstance(body, dict) and body.get("model") not in (None, "", alias):
            return error(404, f"the model {body.get('model')!r} does not exist; this server serves {alias!r}",
                         "model_not_found")
        try:
            reply = await run_in_threadpool(engine.chat, body, max_tokens_cap, _stop_now, alias,
                                            always_token_ids, _client_gone)
        except RequestError as e:
            return error(e.status, str(e), e.code)
        return JSONResponse(reply)

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ])


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from tasks.local_chat import DEFAULT_TOOL_FORMAT, TOOL_FORMATS, ChatEngine

    p = argparse.ArgumentParser(description="sandflow's embedded model server")
    p.add_argument("--max-tokens-cap", type=int, default=1024)
    p.add_argument("--model", required=True, help="the .gguf file")
    p.add_argument("--model_alias", default="local")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--n_ctx", type=int, default=8192)
    p.add_argument("--n_threads", type=int, default=2)
    p.add_argument("--n_batch", type=int, default=512)
    p.add_argument("--slots", type=int, default=1, help="llama.cpp contexts (episodes served at once)")
    p.add_argument("--token-ids", choices=("asked", "always"), default="asked",
                   help="return prompt/completion token ids and logprobs when asked (vLLM's "
                   "return_token_ids) or on every reply")
    p.add_argument("--tool-format", choices=TOOL_FORMATS, default=DEFAULT_TOOL_FORMAT,
                   help="how tools, tool calls and results are rendered (tasks/local_chat.py)")
    p.add_argument("--verbose", default="False")
    args = p.parse_args(argv)
    if args.max_tokens_cap < 1:
        raise SystemExit("--max-tokens-cap must be at least 1")
    if not 1 <= args.slots <= 16:
        raise SystemExit("--slots must be between 1 and 16")
    engine = ChatEngine(args.model, n_ctx=args.n_ctx, n_threads=args.n_threads, slots=args.slots,
                        n_batch=args.n_batch, verbose=args.verbose.lower() == "true", tool_format=args.tool_format)
    app = create_app(engine, args.model_alias, args.max_tokens_cap, args.token_ids == "always")
    wrapped = CancelOnDisconnect(
        app, args.max_tokens_cap, log=lambda m: print(m, file=sys.stderr, flush=True)
    )
    uvicorn.run(wrapped, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
