"""The embedded model's server process: llama-cpp-python's OpenAI server, made to stop
working for clients that are gone.

llama-cpp-python's server computes a non-streamed completion to its end even after the
client has hung up (a timed-out call), and a retry then waits behind the abandoned
work on the same CPU. Two bounds fix that here, both inside the server process:

- cancel on disconnect: an ASGI middleware reads the request body, then watches the
  connection; when the client leaves, the generation stops at its next token (a
  stopping criterion added to every ``Llama.create_completion`` call of the request);
- a token budget per request: max_tokens, bounded by ``--max-tokens-cap`` (a request
  asking for more, or for no limit, gets the cap), counted over EVERY generation the
  request makes. llama-cpp-python's chatml-function-calling handler generates a
  message or each tool call's arguments with ``max_tokens=None`` (measured: a call
  asking for 512 tokens generated 3,068 in 190 s), so the request's own max_tokens
  alone bounds nothing there.

Run as ``python -m tasks.local_model_app --max-tokens-cap N <llama_cpp.server args>``;
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


def _stop_now(*_: Any) -> bool:
    budget = _BUDGET.get()
    return budget is not None and budget.stop_now()


def install_cancellation() -> None:
    """Give every Llama.create_completion a stopping criterion that fires when its
    request's client has left or its token budget is spent (the chat handlers all
    generate through it)."""
    import llama_cpp

    original = llama_cpp.Llama.create_completion
    if getattr(original, "_sandflow_cancellable", False):
        return

    def create_completion(self: Any, *args: Any, **kwargs: Any) -> Any:
        criteria = kwargs.get("stopping_criteria")
        extra = llama_cpp.StoppingCriteriaList([_stop_now])
        kwargs["stopping_criteria"] = extra if criteria is None else criteria + extra
        return original(self, *args, **kwargs)

    create_completion._sandflow_cancellable = True  # type: ignore[attr-defined]
    llama_cpp.Llama.create_completion = create_completion  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--max-tokens-cap", type=int, default=1024)
    known, rest = ours.parse_known_args(argv)
    if known.max_tokens_cap < 1:
        raise SystemExit("--max-tokens-cap must be at least 1")
    parser = argparse.ArgumentParser(description="sandflow's embedded model server")
    add_args_from_model(parser, Settings)
    args = parser.parse_args(rest)
    server_settings: Any = parse_model_from_args(ServerSettings, args)
    model_settings: Any = [parse_model_from_args(ModelSettings, args)]
    install_cancellation()
    app = create_app(server_settings=server_settings, model_settings=model_settings)
    wrapped = CancelOnDisconnect(
        app, known.max_tokens_cap, log=lambda m: print(m, file=sys.stderr, flush=True)
    )
    uvicorn.run(wrapped, host=server_settings.host, port=server_settings.port, log_level="warning")


if __name__ == "__main__":
    main()
