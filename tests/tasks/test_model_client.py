"""The model client against a real HTTP server (the scripted model): retries, errors, extras."""

from __future__ import annotations

import pytest

from tasks.model import (
    ContextLengthError,
    ModelClient,
    ModelConfig,
    ModelError,
    ModelNotServedError,
)
from tests.scripted_model import Fault, Reply, ScriptedModel, text_reply, tool_call

MSGS = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def fast_cfg(server: ScriptedModel, **kw: object) -> ModelConfig:
    base = dict(
        model="scripted", base_url=server.url, max_retries=3, backoff_initial_s=0.01,
        backoff_max_s=0.05, request_timeout_s=5.0,
    )
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_rate_limit_then_success_honours_retry_after(scripted_model: ScriptedModel) -> None:
    scripted_model.push(Fault.rate_limit(retry_after=0.3), text_reply("hi"))
    client = ModelClient(fast_cfg(scripted_model))
    waits: list[float] = []
    orig = client._wait
    client._wait = lambda state: waits.append(orig(state)) or waits[-1]  # type: ignore[method-assign]
    reply = client.complete(MSGS)
    assert reply.content == "hi"
    assert reply.attempts == 2
    assert len(scripted_model.requests) == 2
    # The wait came from Retry-After (0.3 s), not from the 0.01 s backoff.
    assert waits and waits[0] >= 0.3


def test_server_error_forever_is_a_model_error(scripted_model: ScriptedModel) -> None:
    scripted_model.default = Fault.server_error(500)
    client = ModelClient(fast_cfg(scripted_model, max_retries=2))
    with pytest.raises(ModelError, match=r"after 3 attempt\(s\): HTTP 500"):
        client.complete(MSGS)
    assert len(scripted_model.requests) == 3


def test_dropped_connection_and_non_json_are_retried(scripted_model: ScriptedModel) -> None:
    scripted_model.push(Fault.drop(), Fault.non_json(), text_reply("ok"))
    reply = ModelClient(fast_cfg(scripted_model)).complete(MSGS)
    assert reply.content == "ok"
    assert reply.attempts == 3


def test_hang_past_timeout(scripted_model: ScriptedModel) -> None:
    scripted_model.default = Fault.hang(20)
    client = ModelClient(fast_cfg(scripted_model, request_timeout_s=0.5, max_retries=1))
    with pytest.raises(ModelError, match="timed out"):
        client.complete(MSGS)
    assert len(scripted_model.requests) == 2


def test_context_length_error_carries_numbers(scripted_model: ScriptedModel) -> None:
    scripted_model.push(Fault.context_length(max_context=4096, prompt_tokens=4000))
    with pytest.raises(ContextLengthError) as info:
        ModelClient(fast_cfg(scripted_model)).complete(MSGS, max_tokens=500)
    assert (info.value.max_context, info.value.prompt_tokens) == (4096, 4000)
    assert len(scripted_model.requests) == 1  # not retried blindly


def test_unknown_model_name(scripted_model: ScriptedModel) -> None:
    with pytest.raises(ModelNotServedError, match="does not serve model 'nope'"):
        ModelClient(fast_cfg(scripted_model, model="nope")).complete(MSGS)
    assert ModelClient(fast_cfg(scripted_model)).served_models() == ["scripted"]


def test_unreachable_endpoint() -> None:
    from tasks.local_model import free_port

    cfg = ModelConfig(model="m", base_url=f"http://127.0.0.1:{free_port()}/v1", max_retries=1,
                      backoff_initial_s=0.01)
    with pytest.raises(ModelError, match="connection failed"):
        ModelClient(cfg).complete(MSGS)
    with pytest.raises(ModelError, match="cannot reach"):
        ModelClient(cfg).served_models()


def test_usage_reasoning_tokens_and_logprobs(scripted_model: ScriptedModel) -> None:
    scripted_model.push(
        Reply(
            content="x",
            tool_calls=[tool_call("execute_bash", {"command": "ls"}, "c1")],
            reasoning_content="thinking",
            usage={
                "prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                "prompt_tokens_details": {"cached_tokens": 64},
                "completion_tokens_details": {"reasoning_tokens": 3},
            },
            completion_token_ids=[11, 12, 13],
            prompt_token_ids=[1, 2, 3, 4],
            logprobs=[-0.1, -0.2, -0.3],
        )
    )
    cfg = fast_cfg(scripted_model, logprobs=True, return_token_ids=True,
                   extra_body={"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}},
                   temperature=0.3, max_tokens=99)
    reply = ModelClient(cfg).complete(MSGS, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert reply.usage.model_dump() == {
        "prompt_tokens": 100, "completion_tokens": 7, "cached_tokens": 64, "reasoning_tokens": 3,
    }
    assert reply.reasoning_content == "thinking"
    assert reply.finish_reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [("c1", "execute_bash", '{"command": "ls"}')]
    assert reply.completion_token_ids == [11, 12, 13]
    assert reply.prompt_token_ids == [1, 2, 3, 4]
    assert reply.completion_logprobs == [-0.1, -0.2, -0.3]
    body = scripted_model.requests[0]
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True
    assert body["top_k"] == 20 and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["temperature"] == 0.3 and body["max_tokens"] == 99
    assert body["tools"][0]["function"]["name"] == "f"


def test_token_ids_from_token_id_strings(scripted_model: ScriptedModel) -> None:
    """Without `token_ids`, vLLM's 'token_id:N' logprob tokens give the exact ids."""

    def reply(body: dict, index: int) -> Reply:
        r = Reply(content="ab", completion_token_ids=[5, 6], logprobs=[-1.0, -2.0])
        out = r.body(body)
        del out["choices"][0]["token_ids"]
        return _Raw(out)  # type: ignore[return-value]

    class _Raw(Reply):
        def __init__(self, payload: dict) -> None:
            super().__init__()
            self.payload = payload

        def body(self, request: dict) -> dict:
            return self.payload

    scripted_model.push(reply)
    got = ModelClient(fast_cfg(scripted_model, logprobs=True)).complete(MSGS)
    assert got.completion_token_ids == [5, 6]
    assert got.completion_logprobs == [-1.0, -2.0]


def test_api_key_goes_only_to_the_auth_header(scripted_model: ScriptedModel) -> None:
    secret = "sk-test-DO-NOT-LEAK-4711"
    cfg = fast_cfg(scripted_model, api_key=secret)
    scripted_model.push(text_reply("ok"))
    ModelClient(cfg).complete(MSGS)
    assert scripted_model.headers[0]["authorization"] == f"Bearer {secret}"
    assert secret.encode() not in scripted_model.raw_requests[0]
    assert secret not in repr(cfg) and secret not in str(cfg.public_dict())
    assert "api_key" not in cfg.public_dict()


def test_key_echoed_by_the_server_is_scrubbed(scripted_model: ScriptedModel) -> None:
    secret = "sk-test-ECHOED-123456"
    scripted_model.default = Fault("status", 500, message=f"upstream rejected key {secret}")
    with pytest.raises(ModelError) as info:
        ModelClient(fast_cfg(scripted_model, api_key=secret, max_retries=1)).complete(MSGS)
    assert secret not in str(info.value) and "upstream rejected key ***" in str(info.value)


def test_scripted_model_wait_for_requests(scripted_model: ScriptedModel) -> None:
    import threading

    scripted_model.push(text_reply("a"))
    assert not scripted_model.wait_for_requests(1, timeout=0.05)
    t = threading.Thread(target=lambda: ModelClient(fast_cfg(scripted_model)).complete(MSGS))
    t.start()
    assert scripted_model.wait_for_requests(1, timeout=10)
    t.join()
    assert scripted_model.requests[0]["messages"] == MSGS


def test_retries_stop_at_the_callers_deadline(scripted_model: ScriptedModel) -> None:
    """A long Retry-After is not slept through when the episode has less time left."""
    scripted_model.default = Fault.rate_limit(retry_after=30)
    client = ModelClient(fast_cfg(scripted_model, max_retries=5))
    with pytest.raises(ModelError, match="HTTP 429"):
        client.complete(MSGS, timeout_s=2.0)
    assert len(scripted_model.requests) == 1


def test_the_environment_proxy_is_used_unless_no_proxy_exempts_the_endpoint(
    scripted_model: ScriptedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chat calls go straight to httpx's transport, not through an httpx.Client, so the
    HTTP(S)_PROXY / NO_PROXY an httpx.Client would honour are read by the model client.
    The "proxy" is a second scripted server: it answers the absolute-URL request."""
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                 "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with ScriptedModel(default=text_reply("via the proxy")) as proxy:
        scripted_model.default = text_reply("direct")
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        assert ModelClient(fast_cfg(scripted_model)).complete(MSGS).content == "via the proxy"
        assert (proxy.count, scripted_model.count) == (1, 0)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert ModelClient(fast_cfg(scripted_model)).complete(MSGS).content == "direct"
        assert (proxy.count, scripted_model.count) == (1, 1)
