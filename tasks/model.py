"""The model side of an episode: one OpenAI-compatible chat call, made robust.

Works against vLLM, SGLang, llama.cpp and OpenAI through the openai SDK. What this
module adds on top of the SDK:

- retries with exponential backoff and full jitter on 429 / 5xx / timeouts / dropped
  connections, honouring the server's Retry-After (tenacity; the SDK's own retries are
  off so there is one policy, and each retry is logged without secrets);
- a context-length error is not retried blindly: the caller learns the numbers the
  server gave (``ContextLengthError``) and can shrink max_tokens or stop the episode;
- everything RL and accounting need is pulled out of the reply: usage (prompt /
  completion / cached / reasoning tokens), finish_reason, reasoning content, and the
  completion token ids + logprobs exactly as the server returned them (vLLM returns
  ids with ``return_token_ids`` or as ``token_id:N`` strings with
  ``return_tokens_as_token_ids``); text is never re-tokenized here.

The API key is a SecretStr: it goes to the SDK and nowhere else (`public_dict` drops it).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import openai
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, Field, SecretStr
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt
from tenacity.stop import stop_base

from tasks.records import ToolCall, Usage

log = logging.getLogger(__name__)

# Used when the server needs some key but none was configured (local servers).
PLACEHOLDER_KEY = "sandflow-no-key"

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
    temperature: float = Field(0.7, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int = Field(2048, ge=1, description="completion tokens per call")
    min_max_tokens: int = Field(
        64, ge=1, description="a context-length error shrinks max_tokens down to this, then stops"
    )
    request_timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(4, ge=0, description="retries on 429/5xx/timeouts/dropped connections")
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
@dataclass
class ModelReply:
    """One assistant message plus what the server said about producing it."""

    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None
    finish_reason: str | None
    usage: Usage
    latency_s: float
    attempts: int = 1
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    max_tokens_used: int = 0
    raw_extra: dict[str, Any] = field(default_factory=dict)

    def as_message(self) -> dict[str, Any]:
        """The assistant message as it goes back into the history (OpenAI wire format).

        A tool-call-only reply is sent back with content "" rather than null: llama.cpp's
        server rejects a null content, and every other server treats both alike.
        """
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


def _extra(obj: Any) -> dict[str, Any]:
    """Fields the SDK's typed models don't declare (vLLM/llama.cpp extensions)."""
    extra = getattr(obj, "model_extra", None)
    return dict(extra) if extra else {}


def _parse_reply(resp: Any, latency: float) -> ModelReply:
    if not getattr(resp, "choices", None):
        raise ModelError(f"the server returned no choices: {str(resp)[:200]}")
    choice = resp.choices[0]
    msg = choice.message
    msg_extra = _extra(msg)
    reasoning = msg_extra.get("reasoning_content") or msg_extra.get("reasoning")
    calls = [
        ToolCall(
            id=c.id or f"call_{i}",
            name=c.function.name or "",
            arguments=c.function.arguments or "",
        )
        for i, c in enumerate(msg.tool_calls or [])
        if getattr(c, "function", None) is not None
    ]
    usage = Usage()
    if resp.usage is not None:
        u = resp.usage
        usage.prompt_tokens = u.prompt_tokens
        usage.completion_tokens = u.completion_tokens
        ptd = getattr(u, "prompt_tokens_details", None)
        if ptd is not None and getattr(ptd, "cached_tokens", None) is not None:
            usage.cached_tokens = ptd.cached_tokens
        ctd = getattr(u, "completion_tokens_details", None)
        if ctd is not None and getattr(ctd, "reasoning_tokens", None) is not None:
            usage.reasoning_tokens = ctd.reasoning_tokens

    # Exact tokens: ids the server gave, never re-tokenized text.
    choice_extra = _extra(choice)
    resp_extra = _extra(resp)
    completion_ids = choice_extra.get("token_ids")
    prompt_ids = resp_extra.get("prompt_token_ids") or choice_extra.get("prompt_token_ids")
    logprobs: list[float] | None = None
    lp = getattr(choice, "logprobs", None)
    content_lps = getattr(lp, "content", None) if lp is not None else None
    if content_lps:
        logprobs = [float(t.logprob) for t in content_lps]
        if completion_ids is None:
            ids = [_token_id(t.token) for t in content_lps]
            if all(i is not None for i in ids):
                completion_ids = ids
    return ModelReply(
        content=msg.content,
        tool_calls=calls,
        reasoning_content=reasoning,
        finish_reason=choice.finish_reason,
        usage=usage,
        latency_s=latency,
        prompt_token_ids=list(prompt_ids) if prompt_ids else None,
        completion_token_ids=list(completion_ids) if completion_ids is not None else None,
        completion_logprobs=logprobs,
    )


def _token_id(token: str | None) -> int | None:
    """vLLM's `return_tokens_as_token_ids` renders each token as 'token_id:<int>'."""
    if token and token.startswith("token_id:"):
        try:
            return int(token[9:])
        except ValueError:
            return None
    return None


# --------------------------------------------------------------------------- retries
def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError)):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    # A 200 whose body is not a chat completion (proxy error page): transient.
    return isinstance(exc, _BadBody)


class _BadBody(Exception):
    pass


def _retry_after(exc: BaseException | None) -> float | None:
    resp = getattr(exc, "response", None)
    headers = getattr(resp, "headers", None)
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

    def __call__(self, state: RetryCallState) -> bool:
        if self.deadline is None:
            return False
        return time.monotonic() + (state.upcoming_sleep or 0.0) >= self.deadline


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
        self._client = openai.OpenAI(
            base_url=cfg.base_url, api_key=key, timeout=cfg.request_timeout_s, max_retries=0
        )

    def close(self) -> None:
        self._client.close()

    # Backoff: full jitter on an exponential ceiling, or the server's Retry-After.
    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        after = _retry_after(exc)
        if after is not None:
            return min(after, self.cfg.max_retry_after_s) + random.uniform(0, 0.1)
        ceiling = min(self.cfg.backoff_max_s, self.cfg.backoff_initial_s * 2 ** (state.attempt_number - 1))
        return random.uniform(0, ceiling)

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "model call failed (attempt %d/%d): %s; retrying in %.2fs",
            state.attempt_number,
            self.cfg.max_retries + 1,
            self.scrub(_describe(exc)),
            state.upcoming_sleep,
        )

    def request_body(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, max_tokens: int
    ) -> dict[str, Any]:
        """The keyword arguments of one chat.completions.create call."""
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
        extra = dict(cfg.extra_body)
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
        """POST /chat/completions through the SDK client (auth, timeouts, typed errors).

        Not `chat.completions.create`: its request "transform" walks every message of the
        conversation on every call, which cost ~45% of an episode's Python CPU at 10 turns
        (quadratic in the conversation). Our messages are already plain JSON.
        """
        body = {k: v for k, v in kwargs.items() if k not in ("extra_body", "timeout")}
        body.update(kwargs.get("extra_body") or {})
        options: dict[str, Any] = {}
        if "timeout" in kwargs:
            options["timeout"] = kwargs["timeout"]
        return self._client.post("/chat/completions", body=body, cast_to=ChatCompletion, options=options)  # type: ignore[call-overload]

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
    ) -> ModelReply:
        """One chat call with retries. Raises ContextLengthError, ModelNotServedError, ModelError.

        Error messages end up in records and logs, so the key is scrubbed from them.
        """
        try:
            return self._complete(messages, tools, max_tokens, timeout_s)
        except ModelError as exc:
            exc.args = tuple(self.scrub(a) if isinstance(a, str) else a for a in exc.args)
            raise

    def _complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        max_tokens: int | None,
        timeout_s: float | None,
    ) -> ModelReply:
        max_tokens = max_tokens or self.cfg.max_tokens
        kwargs = self.request_body(messages, tools, max_tokens)
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
            if isinstance(resp, (str, bytes)) or not hasattr(resp, "choices"):
                raise _BadBody(f"the server's reply is not a chat completion: {str(resp)[:120]!r}")
            return _parse_reply(resp, time.perf_counter() - t0)

        retrying = Retrying(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.cfg.max_retries + 1) | _past(deadline),
            wait=self._wait,
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            reply = retrying(once)
        except openai.BadRequestError as exc:
            message = _message(exc)
            if _is_context_error(message):
                ctx, prompt = _parse_context_numbers(message)
                raise ContextLengthError(message, ctx, prompt) from None
            raise ModelError(f"the server rejected the request (400): {message}") from None
        except openai.NotFoundError as exc:
            raise ModelNotServedError(
                f"the server at {self.cfg.base_url} does not serve model {self.cfg.model!r} "
                f"(404: {_message(exc)})"
            ) from None
        except openai.AuthenticationError:
            raise ModelError(
                f"the server at {self.cfg.base_url} refused the API key (401): set SANDFLOW_API_KEY"
            ) from None
        except Exception as exc:  # retries exhausted or not retryable
            if isinstance(exc, openai.APIStatusError) and _is_context_error(_message(exc)):
                ctx, prompt = _parse_context_numbers(_message(exc))
                raise ContextLengthError(_message(exc), ctx, prompt) from None
            raise ModelError(
                f"model call to {self.cfg.base_url} failed after {attempts} attempt(s): {_describe(exc)}"
            ) from None
        reply.attempts = attempts
        reply.max_tokens_used = max_tokens
        return reply

    def served_models(self, timeout_s: float = 10.0) -> list[str]:
        """Model names the server lists at /models (empty if it has no such route)."""
        try:
            page = self._client.with_options(timeout=timeout_s, max_retries=0).models.list()
        except openai.APIConnectionError as exc:
            raise ModelError(f"cannot reach the model server at {self.cfg.base_url}: {_describe(exc)}") from None
        except openai.APIStatusError:
            return []
        return [m.id for m in page.data]


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
    if isinstance(exc, openai.APITimeoutError):
        return "request timed out"
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        return f"connection failed ({type(cause).__name__ if cause else 'no response'})"
    if isinstance(exc, openai.APIStatusError):
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
