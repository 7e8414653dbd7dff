"""A scripted OpenAI-compatible chat server on 127.0.0.1, for tests and benchmarks.

Real HTTP, real client: the code under test talks to it exactly as it would talk to
vLLM or OpenAI, and the server records every request body it receives, so tests can
check what was *sent* (append-only history, sampling parameters, no secrets).

Usage::

    with ScriptedModel([tool_reply("execute_bash", {"command": "ls"}),
                        Fault.rate_limit(retry_after=0.1),
                        tool_reply("submit", {})]) as model:
        client = OpenAI(base_url=model.url, api_key="x")
        ...
        assert model.requests[0]["messages"][0]["role"] == "system"

Script items are consumed one per chat request, in order. Each item is a `Reply`
(an assistant message), a `Fault` (an error the server produces instead), or a
callable ``fn(body: dict, index: int) -> Reply | Fault`` deciding from the request.
When the script runs out, `default` answers (a Reply, Fault or callable; by default
a 500 fault, so a test that over-runs its script fails loudly rather than hanging).

Faults: ``Fault.rate_limit(retry_after)`` (429 with Retry-After), ``Fault.server_error(500)``,
``Fault.hang(seconds)`` (no answer until then, or until `stop()`),
``Fault.drop()`` (connection closed without a response), ``Fault.non_json()``
(200 with an HTML body), ``Fault.raw_body(text)`` (200 with that text as the body),
``Fault.context_length(max_context, prompt_tokens)`` (vLLM's
400 message for an over-long request).

``GET /v1/models`` lists `models`; a chat request naming another model gets a 404
like vLLM's ("The model `x` does not exist."). ``models=()`` accepts any name.

Reading what arrived: ``requests`` (chat bodies, in order), ``headers`` (lower-cased
names), ``raw_requests`` (bytes as sent), ``wait_for_requests(n, timeout)`` (block until
n chat requests arrived, e.g. to kill a client mid-episode).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Fault", "Reply", "ScriptedModel", "ScriptedModelProcess", "serve_until_eof", "ToyTokenizer", "text_reply", "tool_reply", "tool_call"]


def tool_call(name: str, arguments: dict[str, Any] | str, call_id: str | None = None) -> dict:
    """One tool call in OpenAI's wire format; `arguments` may be raw (even invalid) JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


@dataclass
class Reply:
    """An assistant message the server returns (one choice)."""

    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    reasoning_content: str | None = None
    finish_reason: str | None = None  # default: "tool_calls" if tool_calls else "stop"
    usage: dict[str, Any] | None = None  # default: a rough count from the request
    # Exact-token extras, as vLLM returns them when asked.
    completion_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[float] | None = None  # one per completion token
    delay_s: float = 0.0  # think time before answering

    def body(self, request: dict) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": self.finish_reason or ("tool_calls" if self.tool_calls else "stop"),
        }
        if self.logprobs is not None:
            ids = self.completion_token_ids or list(range(len(self.logprobs)))
            choice["logprobs"] = {
                "content": [
                    {"token": f"token_id:{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for i, lp in zip(ids, self.logprobs, strict=False)
                ]
            }
        if self.completion_token_ids is not None:
            choice["token_ids"] = self.completion_token_ids
        usage = self.usage or _rough_usage(request, self)
        out: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model", "scripted"),
            "choices": [choice],
            "usage": usage,
        }
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out


def _rough_usage(request: dict, reply: Reply) -> dict[str, int]:
    prompt = len(json.dumps(request.get("messages", []))) // 4
    completion = (len(reply.content or "") + len(json.dumps(reply.tool_calls))) // 4 + 1
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def text_reply(content: str, **kw: Any) -> Reply:
    """An assistant message without tool calls."""
    return Reply(content=content, **kw)


def tool_reply(
    name: str, arguments: dict[str, Any] | str | None = None, content: str | None = None, **kw: Any
) -> Reply:
    """An assistant message with one tool call (use `Reply(tool_calls=[...])` for several)."""
    return Reply(content=content, tool_calls=[tool_call(name, arguments or {})], **kw)


@dataclass
class Fault:
    """An error the server produces instead of a reply."""

    kind: str
    status: int = 500
    retry_after: float | None = None
    seconds: float = 0.0
    message: str = ""

    @classmethod
    def rate_limit(cls, retry_after: float = 0.1) -> Fault:
        return cls("status", 429, retry_after=retry_after, message="Rate limit reached")

    @classmethod
    def server_error(cls, status: int = 500) -> Fault:
        return cls("status", status, message="Internal server error")

    @classmethod
    def hang(cls, seconds: float = 30.0) -> Fault:
        return cls("hang", seconds=seconds)

    @classmethod
    def drop(cls) -> Fault:
        return cls("drop")

    @classmethod
    def non_json(cls) -> Fault:
        return cls("non_json", 200)

    @classmethod
    def raw_body(cls, body: str) -> Fault:
        """200 with `body` as the JSON reply, sent as it is (a body json.dumps cannot
        make, e.g. one nested thousands of levels deep)."""
        return cls("raw", 200, message=body)

    @classmethod
    def context_length(cls, max_context: int = 4096, prompt_tokens: int = 3900) -> Fault:
        """vLLM's wording; the client can read both numbers from it."""
        return cls(
            "status",
            400,
            message=(
                f"This model's maximum context length is {max_context} tokens. However, you "
                f"requested {{requested}} tokens ({prompt_tokens} in the messages, {{max_tokens}} in "
                "the completion). Please reduce the length of the messages or completion."
            ),
            seconds=float(prompt_tokens),
        )


ScriptItem = Reply | Fault | Callable[[dict, int], Reply | Fault]


class ScriptedModel:
    """The server. Start with `start()` or a `with` block; `url` is the OpenAI base URL."""

    def __init__(
        self,
        script: Iterable[ScriptItem] = (),
        *,
        default: ScriptItem | None = None,
        models: Iterable[str] = ("scripted",),
        tokenizer: ToyTokenizer | None = None,
        raw_tool_calls: bool = False,
        record: bool = True,
    ) -> None:
        """`tokenizer`: answer with exact token ids and logprobs, vLLM style, when the
        request asks (ToyTokenizer). `raw_tool_calls`: put tool calls in the content as
        Hermes ``<tool_call>`` text, as a server without a tool parser does. `record=False`:
        keep no request (only `count`), for a server that answers many thousands (a
        benchmark's endpoint: what it kept would only grow its garbage collector's work)."""
        self.tokenizer = tokenizer
        self.raw_tool_calls = raw_tool_calls
        self._script: list[ScriptItem] = list(script)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self.default: ScriptItem = default if default is not None else Fault.server_error(500)
        self.models = list(models)
        self.requests: list[dict] = []  # every chat request body, in arrival order
        self.headers: list[dict[str, str]] = []  # their headers, names lower-cased
        self.raw_requests: list[bytes] = []
        self.record = record
        self.count = 0  # chat requests arrived, recorded or not
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- script -------------------------------------------------------------------
    def push(self, *items: ScriptItem) -> None:
        """Append to the script (also while the server is running)."""
        with self._lock:
            self._script.extend(items)

    def _next(self, body: dict) -> Reply | Fault:
        with self._lock:
            index = self.count - 1
            item = self._script.pop(0) if self._script else self.default
        if callable(item) and not isinstance(item, (Reply, Fault)):
            return item(body, index)
        return item

    def wait_for_requests(self, n: int, timeout: float = 30.0) -> bool:
        """Block until at least `n` chat requests arrived; False on timeout."""
        with self._arrived:
            return self._arrived.wait_for(lambda: self.count >= n, timeout)

    # -- lifecycle ------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._server is not None, "ScriptedModel not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ScriptedModel:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="scripted-model", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ScriptedModel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_until_eof(model: ScriptedModel) -> None:
    """Serve `model`, print its URL, stop when stdin closes: the child side of
    ScriptedModelProcess (a benchmark's hidden `--serve-...` flag calls it)."""
    with model:
        print(model.url, flush=True)
        sys.stdin.read()


class ScriptedModelProcess:
    """A scripted model in a process of its own, as a real endpoint is (vLLM, a remote API).

    Why, for a benchmark: in the measuring interpreter its request handling takes the GIL
    from the side being measured, and what it keeps grows the heap that side's garbage
    collections scan. `argv` runs `serve_until_eof`; its first line is the URL.
    """

    def __init__(self, argv: list[str], cwd: str | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http://127.0.0.1:"):
            self.stop()
            raise RuntimeError(f"the scripted model process did not start (it said {line!r})")
        self.url = line

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # its signal to stop
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ScriptedModelProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _make_handler(model: ScriptedModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in separate writes: without this, Nagle's algorithm
            # and delayed ACKs add ~40 ms to every reply on loopback.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, payload: bytes, ctype: str, extra: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(payload)

        def _json(self, status: int, obj: Any, extra: dict | None = None) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json", extra)

        def _error(self, status: int, message: str, extra: dict | None = None) -> None:
            self._json(status, {"error": {"message": message, "type": "error", "code": status}}, extra)

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                data = [{"id": m, "object": "model", "owned_by": "scripted"} for m in model.models]
                self._json(200, {"object": "list", "data": data})
            elif self.path.rstrip("/").endswith("/health"):
                self._json(200, {"status": "ok"})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self._error(404, f"no route {self.path}")
                return
            try:
                body = json.loads(raw)
            except ValueError:
                self._error(400, "request body is not JSON")
                return
            with model._lock:
                model.count += 1
                if model.record:
                    model.requests.append(body)
                    model.raw_requests.append(raw)
                    model.headers.append({k.lower(): v for k, v in self.headers.items()})
                model._arrived.notify_all()
            if model.models and body.get("model") not in model.models:
                self._error(404, f"The model `{body.get('model')}` does not exist.")
                return
            item = model._next(body)
            if isinstance(item, Fault):
                self._fault(item, body)
                return
            if item.delay_s:
                model._stopping.wait(item.delay_s)
            if model.tokenizer is not None:
                item = model.tokenizer.annotate(item, body, model.raw_tool_calls)
            elif model.raw_tool_calls and item.tool_calls:
                import dataclasses

                text = ToyTokenizer().assistant_body(item.content, item.tool_calls)
                item = dataclasses.replace(item, content=text, tool_calls=[])
            if body.get("stream"):
                self._stream(item.body(body), body)
                return
            self._json(200, item.body(body))

        def _stream(self, full: dict, body: dict) -> None:
            """The same reply as server-sent events, as OpenAI streams it (`stream: true`):
            one delta with the whole message, one with the finish reason, the usage when
            `stream_options.include_usage`, then `[DONE]`."""
            choice = full["choices"][0]
            msg = dict(choice["message"])
            delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
            if msg.get("reasoning_content") is not None:
                delta["reasoning_content"] = msg["reasoning_content"]
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
            base = {k: full[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
            events = [
                base | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                base | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
            ]
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append(base | {"choices": [], "usage": full["usage"]})
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            self._send(200, payload + b"data: [DONE]\n\n", "text/event-stream")

        def _fault(self, fault: Fault, body: dict) -> None:
            if fault.kind == "hang":
                model._stopping.wait(fault.seconds)
                self.close_connection = True
                return
            if fault.kind == "drop":
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault.kind == "non_json":
                self._send(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
                return
            if fault.kind == "raw":
                self._send(200, fault.message.encode(), "application/json")
                return
            message = fault.message
            if "{requested}" in message:
                max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
                message = message.replace("{max_tokens}", str(max_tokens)).replace(
                    "{requested}", str(int(fault.seconds) + max_tokens)
                )
            extra = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else None
            self._error(fault.status, message, extra)

    return Handler


# ------------------------------------------------------------------ exact tokens (RL)
class ToyTokenizer:
    """A byte-level tokenizer with a ChatML-like template, for exact-token RL tests.

    Ids 0-255 are bytes; 256 is ``<|im_start|>``, 257 is ``<|im_end|>``. A request's
    prompt ids are ``render(messages)`` with the generation prompt; a reply's completion
    ids are its assistant body (content, then each tool call as a Hermes
    ``<tool_call>`` block) followed by ``<|im_end|>``. Because the template renders an
    assistant message back to exactly the tokens it was generated as, each request's
    prompt ids extend the previous prompt + completion (as vLLM does with an append-only
    history), unless `drop_reasoning` strips ``<think>...</think>`` from earlier
    assistant turns (Qwen3's template does that: the ids then stop extending).

    Logprobs are a fixed function of (token id, position in the completion): `logprob`.
    """

    IM_START = 256
    IM_END = 257

    def __init__(self, drop_reasoning: bool = False) -> None:
        self.drop_reasoning = drop_reasoning

    @staticmethod
    def text_ids(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def logprob(token_id: int, position: int) -> float:
        return -(((token_id * 31 + position) % 97) + 1) / 100

    @staticmethod
    def tool_call_text(name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments or "{}"}}}\n</tool_call>'

    def assistant_body(self, content: str | None, tool_calls: list[dict]) -> str:
        parts = [content or ""]
        for c in tool_calls:
            fn = c.get("function") or {}
            parts.append(("\n" if parts[-1] else "") + self.tool_call_text(fn.get("name", ""), fn.get("arguments", "")))
        return "".join(parts)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids: list[int] = []
        for m in messages:
            role = m.get("role", "")
            if role == "assistant":
                body = self.assistant_body(m.get("content"), m.get("tool_calls") or [])
                if self.drop_reasoning and "</think>" in body:  # past turns' reasoning
                    body = body.split("</think>", 1)[1].lstrip("\n")
            else:
                body = m.get("content") or ""
            ids += [self.IM_START, *self.text_ids(f"{role}\n{body}"), self.IM_END, *self.text_ids("\n")]
        if add_generation_prompt:
            ids += [self.IM_START, *self.text_ids("assistant\n")]
        return ids

    def completion(self, content: str | None, tool_calls: list[dict]) -> list[int]:
        return [*self.text_ids(self.assistant_body(content, tool_calls)), self.IM_END]

    def annotate(self, reply: Reply, request: dict, raw_tool_calls: bool) -> Reply:
        """The reply as a vLLM server returns it with return_token_ids / logprobs."""
        import dataclasses

        content, calls = reply.content, reply.tool_calls
        if raw_tool_calls and calls:
            content, calls = self.assistant_body(content, calls), []
        prompt = self.render(request.get("messages") or [])
        completion = self.completion(content, calls)
        logprobs = [self.logprob(t, i) for i, t in enumerate(completion)] if request.get("logprobs") else None
        return dataclasses.replace(
            reply,
            content=content,
            tool_calls=calls,
            finish_reason=reply.finish_reason or ("tool_calls" if calls else "stop"),
            prompt_token_ids=prompt if request.get("return_token_ids") else None,
            completion_token_ids=completion if request.get("return_token_ids") else None,
            logprobs=logprobs,
            usage={"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                   "total_tokens": len(prompt) + len(completion)},
        )
