"""The model side of an episode: one OpenAI-compatible chat call, made robust.

Works against vLLM, SGLang, llama.cpp and OpenAI: one POST /chat/completions per call
over a pooled httpx client (one per ModelClient; share the client). Not the openai SDK:
its request building, auth-retry layers and typed response models cost ~0.5 ms of CPU
per call on top of the HTTP itself, twice what the call needs (measured on the peer
benchmark, where the model answers instantly: the SDK was most of an episode's Python
CPU). The reply is read as plain JSON, defensively (a server's fields may be missing or
of the wrong type). What this module adds:

- retries with exponential backoff and full jitter on 429 / 5xx / timeouts / dropped
  connections, honouring the server's Retry-After, for as long as the retry window
  (`retry_window_s`, default 150 s: an outage of a minute or two is ridden out) and the
  episode's wall clock allow; a count bound only when `max_retries` is set (tenacity: one
  policy, and each retry is logged without secrets);
- a context-length error is not retried blindly: the caller learns the numbers the
  server gave (``ContextLengthError``) and can shrink max_tokens or stop the episode;
- everything RL and accounting need is pulled out of the reply: usage (prompt /
  completion / cached / reasoning tokens), finish_reason, reasoning content, and the
  completion token ids + logprobs exactly as the server returned them (vLLM returns
  ids with ``return_token_ids`` or as ``token_id:N`` strings with
  ``return_tokens_as_token_ids``); text is never re-tokenized here.

The API key is a SecretStr: it goes to the Authorization header and nowhere else
(`public_dict` drops it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import re
import ssl
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
from pydantic import BaseModel, Field, SecretStr
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
)
from tenacity.stop import stop_base

from tasks.defaults import DEFAULT_MAX_TOKENS, DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_TEMPERATURE
from tasks.replies import ModelReply as ModelReply  # re-exported: its home is tasks.replies
from tasks.replies import message_calls, usage_from_openai

log = logging.getLogger(__name__)

# Used when the server needs some key but none was configured (local servers).
PLACEHOLDER_KEY = "sandflow-no-key"

# How long the retries of one model call go on (429 / 5xx / timeouts / dropped
# connections) before the call is given up as model_error: an endpoint that restarts or is
# overloaded for a minute or two is ridden out, not turned into failed episodes. Always
# within the episode's wall clock (tasks.defaults: 900 s), which also bounds it.
DEFAULT_RETRY_WINDOW_S = 150.0

# Where an endpoint's API key comes from: the environment only, first name set wins.
API_KEY_ENV = ("SANDFLOW_API_KEY", "OPENAI_API_KEY")


def api_key_from_env(names: tuple[str, ...] = API_KEY_ENV) -> SecretStr | None:
    """THE API-key lookup. Keys never travel as parameters (Prefect stores those) or in
    files: each process that calls a model (a command, a Dask worker) reads its own env."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return SecretStr(value)
    return None


class ModelConfig(BaseModel):
    """How to reach a model and how to sample from it (never written with its key)."""

    model: str = Field("default", description="model name as the server serves it")
    base_url: str | None = Field(None, description="OpenAI-compatible base URL, e.g. http://h:8000/v1")
    api_key: SecretStr | None = Field(None, exclude=True, repr=False)
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="completion tokens per call")
    min_max_tokens: int = Field(
        64, ge=1, description="a context-length error shrinks max_tokens down to this, then stops"
    )
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    max_retries: int | None = Field(
        None,
        ge=0,
        description="at most this many retries on 429/5xx/timeouts/dropped connections "
        "(None: only retry_window_s bounds them)",
    )
    retry_window_s: float = Field(
        DEFAULT_RETRY_WINDOW_S,
        ge=0,
        description="retries of one call go on for this long after its first attempt (an "
        "outage of the endpoint is ridden out), never past the episode's wall clock",
    )
    backoff_initial_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    max_retry_after_s: float = Field(120.0, ge=0, description="cap on a server's Retry-After")
    logprobs: bool = Field(False, description="ask for completion logprobs (vLLM, llama.cpp, OpenAI)")
    return_token_ids: bool = Field(
        False,
        description="ask a vLLM server for exact prompt/completion token ids "
        "(return_token_ids, return_tokens_as_token_ids)",
    )
    tool_choice: str | None = Field(
        "auto",
        description="sent with the tools; llama.cpp's chatml-function-calling only offers "
        "tools when it is given explicitly",
    )
    extra_body: dict[str, Any] = Field(default_factory=dict, description="passed through as-is")

    def public_dict(self) -> dict[str, Any]:
        """Safe to record anywhere: the key is never included."""
        return self.model_dump(mode="json", exclude={"api_key"})


# --------------------------------------------------------------------------- errors
class ModelError(RuntimeError):
    """The endpoint failed (after retries): infrastructure, not the model's answer."""


class ContextLengthError(ModelError):
    """The request does not fit the model's context; numbers parsed when the server gives them."""

    def __init__(
        self, message: str, max_context: int | None = None, prompt_tokens: int | None = None
    ) -> None:
        super().__init__(message)
        self.max_context = max_context
        self.prompt_tokens = prompt_tokens


class ModelNotServedError(ModelError):
    """The server does not serve the requested model name."""


class EndpointUnreachable(ModelError):
    """Nothing answers at the endpoint (checked before an episode or run starts)."""

    def __init__(self, message: str, base_url: str | None) -> None:
        super().__init__(message)
        self.base_url = base_url


_CTX_PATTERNS = (
    "maximum context length",
    "context_length_exceeded",
    "context length",
    "exceed context window",
    "exceeds the context",
    "longer than the model's context",
    "too many tokens",
    "prompt is too long",
)


def _is_context_error(message: str) -> bool:
    low = message.lower()
    return any(p in low for p in _CTX_PATTERNS)


def _parse_context_numbers(message: str) -> tuple[int | None, int | None]:
    """(max_context, prompt_tokens) from vLLM / SGLang / llama.cpp wordings, when present."""
    ctx = prompt = None
    m = re.search(r"maximum context length is (\d+)", message) or re.search(
        r"context (?:window|length) of (\d+)", message
    )
    if m is None:
        m = re.search(r"model's context length \((\d+)", message)
    if m:
        ctx = int(m.group(1))
    p = re.search(r"(\d+) in the messages", message) or re.search(
        r"input \((\d+) tokens\)", message
    )
    if p:
        prompt = int(p.group(1))
    return ctx, prompt


# --------------------------------------------------------------------------- reply
def _obj(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else {} (a server's field of the wrong type)."""
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _parse_reply(data: dict[str, Any], latency: float) -> ModelReply:
    """A chat completion (the JSON object) as a ModelReply; fields of the wrong type are
    read as missing, never trusted as what they claim to be."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ModelError(f"the server returned no choices: {str(data)[:200]}")
    choice = choices[0]
    msg = _obj(choice.get("message"))
    reasoning = _text(msg.get("reasoning_content")) or _text(msg.get("reasoning"))
    # tool calls and usage: tasks.replies, the one reader (its rule for what is malformed)
    calls = message_calls(msg.get("tool_calls"))
    usage = usage_from_openai(data.get("usage"))

    # Exact tokens: ids the server gave, never re-tokenized text.
    completion_ids = _ints(choice.get("token_ids"))
    prompt_ids = _ints(data.get("prompt_token_ids")) or _ints(choice.get("prompt_token_ids"))
    logprobs: list[float] | None = None
    content_lps = _obj(choice.get("logprobs")).get("content")
    if isinstance(content_lps, list) and content_lps:
        entries = [_obj(t) for t in content_lps]
        values = [t.get("logprob") for t in entries]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            logprobs = [float(v) for v in values if v is not None]
        if completion_ids is None:
            ids = [_token_id(_text(t.get("token"))) for t in entries]
            if all(i is not None for i in ids):
                completion_ids = ids  # type: ignore[assignment]
    content = msg.get("content")
    return ModelReply(
        content=content if isinstance(content, str) else None,
        tool_calls=calls,
        reasoning_content=reasoning,
        finish_reason=_text(choice.get("finish_reason")),
        usage=usage,
        latency_s=latency,
        prompt_token_ids=prompt_ids or None,
        completion_token_ids=completion_ids,
        completion_logprobs=logprobs,
    )


# A token id is an index into a vocabulary (the largest are ~2^18): one outside
# [0, 2^31) is not an id, and the whole list is read as missing.
MAX_TOKEN_ID = 2**31 - 1


def _ints(value: Any) -> list[int] | None:
    """A list of token ids, or None when it is missing or not a list of token ids."""
    if not isinstance(value, list) or not all(
        (v := _int(x)) is not None and 0 <= v <= MAX_TOKEN_ID for x in value
    ):
        return None
    return list(value)


def _token_id(token: str | None) -> int | None:
    """vLLM's `return_tokens_as_token_ids` renders each token as 'token_id:<int>'."""
    if token and token.startswith("token_id:"):
        try:
            value = int(token[9:])
        except ValueError:
            return None
        return value if 0 <= value <= MAX_TOKEN_ID else None
    return None


# --------------------------------------------------------------------------- retries
class HTTPStatusError(Exception):
    """The server answered with an error status (the body as JSON when it is JSON)."""

    def __init__(self, status_code: int, body: Any, headers: httpx.Headers) -> None:
        self.status_code = status_code
        self.body = body  # dict (JSON) or text
        self.headers = headers
        self.message = body if isinstance(body, str) else f"HTTP {status_code}"
        super().__init__(f"HTTP {status_code}")


def _status_error(resp: httpx.Response) -> HTTPStatusError:
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text[:2000]
    return HTTPStatusError(resp.status_code, body, resp.headers)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):  # timeouts, refused / dropped connections
        return True
    if isinstance(exc, HTTPStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    # A 200 whose body is not a chat completion (proxy error page): transient.
    return isinstance(exc, _BadBody)


class _BadBody(Exception):
    pass


def _retry_after(exc: BaseException | None) -> float | None:
    headers = getattr(exc, "headers", None)
    if not headers:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            continue  # an HTTP date: fall back to backoff
    return None


class _past(stop_base):
    """Stop retrying when the next sleep would end after `deadline` (monotonic)."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.fired = False

    def __call__(self, state: RetryCallState) -> bool:
        if self.deadline is None:
            return False
        self.fired = time.monotonic() + (state.upcoming_sleep or 0.0) >= self.deadline
        return self.fired


class _window(stop_base):
    """Stop when an attempt ends at or after `end` (monotonic): the retry window, counted
    from the call's first attempt (tenacity's stop_after_delay counts from its own start,
    which is after the first attempt here: see ModelClient._complete)."""

    def __init__(self, end: float) -> None:
        self.end = end

    def __call__(self, state: RetryCallState) -> bool:
        return (state.outcome_timestamp or time.monotonic()) >= self.end


def _replaying(first: BaseException, call: Any) -> Any:
    """`call`, except that its first invocation raises `first` (an attempt already made)."""
    pending = [first]

    def again() -> Any:
        if pending:
            raise pending.pop()
        return call()

    return again


def _environment_proxy(url: str) -> str | None:
    """The proxy HTTP(S)_PROXY / ALL_PROXY name for `url`, unless NO_PROXY exempts it:
    what an httpx.Client would pick from the environment on its own."""
    proxies = urllib.request.getproxies_environment()
    host = httpx.URL(url).host
    if not proxies or (host and urllib.request.proxy_bypass(host)):
        return None
    scheme = "https" if url.lower().startswith("https:") else "http"
    return proxies.get(scheme) or proxies.get("all") or None


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context per process (httpx's default trust: certifi, SSL_CERT_FILE/DIR).

    Building one costs ~30 ms of CPU; every client shares it (a context is thread-safe),
    and a plain http:// endpoint never needs one.
    """
    return httpx.create_ssl_context()


class ModelClient:
    """A chat-completions client for one model config. Thread-safe, reuse it."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        if not cfg.base_url:
            raise ValueError(
                "ModelConfig.base_url is empty: start the embedded model (tasks.local_model) "
                "or give --base-url"
            )
        key = cfg.api_key.get_secret_value() if cfg.api_key else PLACEHOLDER_KEY
        base = cfg.base_url.rstrip("/") + "/"
        https = base.lower().startswith("https:")
        headers = {"Authorization": f"Bearer {key}", "Accept": "application/json", "User-Agent": "sandflow"}
        # One transport (one connection pool) for the chat calls and the Client alike. A
        # Client given a transport no longer reads HTTP(S)_PROXY / NO_PROXY itself, so the
        # proxy the environment names for this endpoint is handed to the transport here.
        self._transport = httpx.HTTPTransport(
            verify=_tls_context() if https else False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            proxy=_environment_proxy(base),
        )
        self._http = httpx.Client(
            base_url=base, headers=headers, timeout=cfg.request_timeout_s, transport=self._transport,
        )
        self._chat_url = httpx.URL(base + "chat/completions")
        self._chat_headers = [*headers.items(), ("Content-Type", "application/json")]

    def close(self) -> None:
        self._http.close()

    # Backoff: full jitter on an exponential ceiling, or the server's Retry-After.
    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        after = _retry_after(exc)
        if after is not None:
            return min(after, self.cfg.max_retry_after_s) + random.uniform(0, 0.1)
        ceiling = min(self.cfg.backoff_max_s, self.cfg.backoff_initial_s * 2 ** (state.attempt_number - 1))
        return random.uniform(0, ceiling)

    def _log_retry(self, state: RetryCallState, started: float) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "model call failed (attempt %d, %.1fs of a %gs retry window): %s; retrying in %.2fs",
            state.attempt_number,
            (state.outcome_timestamp or time.monotonic()) - started,
            self.cfg.retry_window_s,
            self.scrub(_describe(exc)),
            state.upcoming_sleep,
        )

    def request_body(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        max_tokens: int,
        extra_body: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments of one chat.completions.create call (`extra_body`: this
        call's fields over the config's)."""
        cfg = self.cfg
        kwargs: dict[str, Any] = {
            "model": cfg.model,
            "messages": messages,
            "temperature": cfg.temperature,
            "max_tokens": max_tokens,
        }
        if cfg.top_p is not None:
            kwargs["top_p"] = cfg.top_p
        if tools:
            kwargs["tools"] = tools
            if cfg.tool_choice:
                kwargs["tool_choice"] = cfg.tool_choice
        extra = {**cfg.extra_body, **extra_body} if extra_body else dict(cfg.extra_body)
        if cfg.logprobs:
            kwargs["logprobs"] = True
            kwargs["top_logprobs"] = 1  # llama.cpp returns logprobs only with top_logprobs
        if cfg.return_token_ids:
            extra.setdefault("return_token_ids", True)
            if cfg.logprobs:
                extra.setdefault("return_tokens_as_token_ids", True)
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _post(self, kwargs: dict[str, Any]) -> Any:
        """POST /chat/completions; the reply's JSON (HTTPStatusError for an error status).

        Our messages are already plain JSON: they are sent as they are (the openai SDK's
        `create` walked every message of the conversation on every call, quadratic in it).
        """
        body = {k: v for k, v in kwargs.items() if k not in ("extra_body", "timeout")}
        body.update(kwargs.get("extra_body") or {})
        # Straight to the transport: the Client's per-request work (URL merging, header
        # normalisation, the cookie jar, redirects, hooks) was ~150 us of CPU a call, a
        # third of a call to a fast local server; none of it applies to this one POST.
        timeout = kwargs.get("timeout", self.cfg.request_timeout_s)
        request = httpx.Request(
            "POST", self._chat_url, headers=self._chat_headers, content=json.dumps(body).encode(),
            extensions={"timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}},
        )
        resp = self._transport.handle_request(request)
        try:
            resp.read()
        finally:
            resp.close()
        if resp.status_code >= 400:
            raise _status_error(resp)
        try:
            return resp.json()
        except ValueError:
            raise _BadBody(f"the server's reply is not JSON: {resp.text[:120]!r}") from None
        except RecursionError:  # not retried: the same reply would come back
            raise ModelError(
                f"the server's reply ({len(resp.content)} bytes) nests JSON deeper than can be "
                "read (send tool-call arguments as JSON text, as the OpenAI API does)"
            ) from None

    def scrub(self, text: str) -> str:
        """`text` without the API key (a server may echo it in an error message)."""
        key = self.cfg.api_key.get_secret_value() if self.cfg.api_key else ""
        return text.replace(key, "***") if len(key) >= 4 else text

    def complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        max_tokens: int | None = None,
        timeout_s: float | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> ModelReply:
        """One chat call with retries. Raises ContextLengthError, ModelNotServedError, ModelError.

        `extra_body`: request fields of this call only (e.g. a structured-output schema
        that differs per call), so callers share one client and its connection pool.
        Error messages end up in records and logs, so the key is scrubbed from them.
        """
        try:
            with self.admitted(timeout_s) as left:
                return self._complete(messages, tools, max_tokens, left, extra_body)
        except ModelError as exc:
            exc.args = tuple(self.scrub(a) if isinstance(a, str) else a for a in exc.args)
            raise

    @contextlib.contextmanager
    def admitted(self, timeout_s: float | None) -> Iterator[float | None]:
        """Where a call waits for its turn before it is made: here at once; a subclass may
        hold it back (engine.slots.LimitedClient: until a model-call slot is free). Yields
        what is left of `timeout_s` (None: no limit) for the call itself."""
        yield timeout_s

    def _complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        max_tokens: int | None,
        timeout_s: float | None,
        extra_body: dict[str, Any] | None = None,
    ) -> ModelReply:
        max_tokens = max_tokens or self.cfg.max_tokens
        kwargs = self.request_body(messages, tools, max_tokens, extra_body)
        # timeout_s is what the caller has left (the episode's wall clock): no attempt and
        # no backoff sleep may run past it.
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        attempts = 0

        def once() -> ModelReply:
            nonlocal attempts
            attempts += 1
            if deadline is not None:
                kwargs["timeout"] = max(0.5, min(deadline - time.monotonic(), self.cfg.request_timeout_s))
            t0 = time.perf_counter()
            resp = self._post(kwargs)
            if not isinstance(resp, dict) or "choices" not in resp:
                raise _BadBody(f"the server's reply is not a chat completion: {str(resp)[:120]!r}")
            return _parse_reply(resp, time.perf_counter() - t0)

        # Retries are bounded by time (the retry window, and the caller's deadline), and by
        # a count only when one is configured: an outage of a minute or two is ridden out.
        started = time.monotonic()
        window_end = started + self.cfg.retry_window_s
        past = _past(deadline)
        stop: stop_base = _window(window_end) | past
        if self.cfg.max_retries is not None:
            stop = stop | stop_after_attempt(self.cfg.max_retries + 1)

        def wait(state: RetryCallState) -> float:
            # The last retry happens at the window's end rather than never: a back-off
            # drawn past it is cut to it.
            return max(0.0, min(self._wait(state), window_end - time.monotonic()))

        def log_retry(state: RetryCallState) -> None:
            self._log_retry(state, started)

        try:
            try:
                # The first attempt runs outside tenacity: most calls succeed at once, and
                # its bookkeeping (~15 us of CPU a call) is then spent for nothing.
                reply = once()
            except Exception as first:
                if not _retryable(first):
                    raise
                # tenacity sees the failed first attempt replayed (its stop, wait and log
                # apply to it as to any attempt), then makes the retries itself.
                retrying = Retrying(
                    retry=retry_if_exception(_retryable),
                    stop=stop,
                    wait=wait,
                    before_sleep=log_retry,
                    reraise=True,
                )
                reply = retrying(_replaying(first, once))
        except HTTPStatusError as exc:
            message = _message(exc)
            if exc.status_code == 400:
                if _is_context_error(message):
                    ctx, prompt = _parse_context_numbers(message)
                    raise ContextLengthError(message, ctx, prompt) from None
                raise ModelError(f"the server rejected the request (400): {message}") from None
            if exc.status_code == 404:
                raise ModelNotServedError(
                    f"the server at {self.cfg.base_url} does not serve model {self.cfg.model!r} "
                    f"(404: {message})"
                ) from None
            if exc.status_code == 401:
                raise ModelError(
                    f"the server at {self.cfg.base_url} refused the API key (401): set SANDFLOW_API_KEY"
                ) from None
            if _is_context_error(message):
                ctx, prompt = _parse_context_numbers(message)
                raise ContextLengthError(message, ctx, prompt) from None
            raise ModelError(
                f"model call to {self.cfg.base_url} failed after {attempts} attempt(s)"
                f"{self._window_note(exc, past, window_end)}: {_describe(exc)}"
            ) from None
        except Exception as exc:  # retries exhausted or not retryable
            if isinstance(exc, HTTPStatusError) and _is_context_error(_message(exc)):
                ctx, prompt = _parse_context_numbers(_message(exc))
                raise ContextLengthError(_message(exc), ctx, prompt) from None
            raise ModelError(
                f"model call to {self.cfg.base_url} failed after {attempts} attempt(s)"
                f"{self._window_note(exc, past, window_end)}: {_describe(exc)}"
            ) from None
        reply.attempts = attempts
        reply.max_tokens_used = max_tokens
        return reply

    def _window_note(self, exc: BaseException, past: _past, window_end: float) -> str:
        """What bounded the retries of a retryable failure, when it was time: the
        episode's wall clock, or the retry window (a count bound says "after N attempts")."""
        if not _retryable(exc):
            return ""
        if past.fired:
            return " (retries stopped: the episode's wall clock ends before another one)"
        if time.monotonic() >= window_end:
            return f" in the retry window of {self.cfg.retry_window_s:g}s"
        return ""

    def served_models(self, timeout_s: float = 10.0) -> list[str]:
        """Model names the server lists at /models (empty if it has no such route)."""
        try:
            resp = self._http.get("models", timeout=timeout_s)
        except httpx.TransportError as exc:
            raise ModelError(
                f"cannot reach the model server at {self.cfg.base_url}: {_describe(exc)}"
            ) from None
        if resp.status_code >= 400:
            return []
        try:
            data = resp.json()
        except ValueError:
            return []
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list):
            return []
        return [m["id"] for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)]


def _message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return str(getattr(exc, "message", None) or exc)


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, httpx.TimeoutException):
        return "request timed out"
    if isinstance(exc, httpx.TransportError):
        return f"connection failed ({type(exc).__name__})"
    if isinstance(exc, HTTPStatusError):
        return f"HTTP {exc.status_code}: {_message(exc)[:200]}"
    if isinstance(exc, json.JSONDecodeError):
        return "the reply is not JSON"
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def preflight(cfg: ModelConfig, *, model_given: bool = True) -> ModelConfig:
    """Check the endpoint before any sandbox starts: THE one preflight of every command.

    Raises EndpointUnreachable when nothing answers, ModelNotServedError when the server
    lists its models and `cfg.model` is not among them. Without a model name given
    (`model_given=False`) the server's model is taken when it serves one (or the named
    one is not served). Returns the config to use.
    """
    client = ModelClient(cfg)
    try:
        served = client.served_models(timeout_s=min(15.0, cfg.request_timeout_s))
    except Exception as exc:
        raise EndpointUnreachable(
            f"the model endpoint {cfg.base_url} does not answer: {exc}", cfg.base_url
        ) from None
    finally:
        client.close()
    if not served:
        return cfg  # the server has no /models route: the first call will tell
    if not model_given and (len(served) == 1 or cfg.model not in served):
        return cfg.model_copy(update={"model": served[0]})
    if cfg.model not in served:
        raise ModelNotServedError(
            f"the endpoint {cfg.base_url} does not serve model {cfg.model!r}; "
            f"it serves: {', '.join(served[:10])}"
        )
    return cfg
