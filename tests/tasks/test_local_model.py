"""The embedded model for real: `sandflow run` with no endpoint starts SmolLM2 via llama.cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.local_model import LocalModelServer, find_gguf
from tasks.model import ModelClient, ModelConfig
from tasks.tools import TOOL_SCHEMAS

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_server_serves_tool_calls() -> None:
    assert find_gguf().suffix == ".gguf"
    with LocalModelServer() as server:
        cfg = ModelConfig(
            model=server.alias,
            base_url=server.base_url,
            max_tokens=64,
            request_timeout_s=300,
            temperature=0,
        )
        client = ModelClient(cfg)
        assert client.served_models() == [server.alias]
        reply = client.complete(
            [
                {"role": "system", "content": "You use tools."},
                {"role": "user", "content": "Call the submit tool now."},
            ],
            TOOL_SCHEMAS,
        )
        # Tiny model: we only require a well-formed reply that names a real tool, if any.
        assert reply.content or reply.tool_calls
        assert all(
            c.name in {"execute_bash", "str_replace_editor", "submit"} for c in reply.tool_calls
        )
        assert (
            reply.usage.prompt_tokens and reply.usage.prompt_tokens > 100
        )  # the tools were in the prompt
        proc = server.proc
    assert proc is not None and proc.poll() is not None  # stopped with the context


@pytest.mark.docker
def test_sandflow_run_end_to_end_with_embedded_model(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SANDFLOW_BASE_URL", "SANDFLOW_MODEL"))
    }
    cmd = [
        sys.executable,
        "-m",
        "sandflow.cli",
        "run",
        "-q",
        "Write the word hello to /testbed/output/answer.txt, then call submit.",
        "-o",
        str(tmp_path),
        "--max-steps",
        "2",
        "--request-timeout",
        "300",
        "--wall-clock",
        "900",
        "--max-tokens",
        "128",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.split()[0] in {"submitted", "max_steps", "context_exhausted"}, summary
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    traj = json.loads((run_dir / "trajectory.json").read_text())
    assert traj["metadata"]["model"] == "smollm2-135m-instruct"
    assert 1 <= len(traj["steps"]) <= 2
    records = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "finish" and "turn" in kinds
    # the embedded server returns the exact token ids on every reply, asked for or not
    turns = [r for r in records if r["kind"] == "turn"]
    assert turns and all(json.dumps(t).count("completion_token_ids\": [") for t in turns), turns[0]


def test_sandflow_serve_foreground_and_ctrl_c() -> None:
    import signal

    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "sandflow.cli", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "serving <alias> at <url> (log: ...); Ctrl+C stops"
        assert line.startswith("serving smollm2-135m-instruct at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        assert (
            httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
            == "smollm2-135m-instruct"
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/models", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_call_whose_client_left_stops_and_tokens_are_capped_by_the_server() -> None:
    """llama-cpp-python alone keeps generating for a client that timed out, and the retry
    waits behind it. The embedded server stops at the client's disconnect and caps
    max_tokens itself."""
    import time

    import httpx

    with LocalModelServer(max_tokens_cap=48) as server:
        url = f"{server.base_url}/chat/completions"
        endless = {
            "model": server.alias,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 1_000_000,  # asks for more than the cap
            "temperature": 0,
            "logit_bias": {"0": -100, "2": -100},  # no end-of-text: only a bound can stop it
        }
        reply = httpx.post(url, json=endless, timeout=300).json()
        assert reply["usage"]["completion_tokens"] == 48  # the server's cap, not the request's
        # With tools, llama-cpp-python generates the message or the arguments with no
        # max_tokens at all (up to n_ctx): the server's budget bounds them too.
        with_tools = dict(endless, max_tokens=32, tools=TOOL_SCHEMAS, tool_choice="auto")
        reply = httpx.post(url, json=with_tools, timeout=300).json()
        assert reply["usage"]["completion_tokens"] <= 32, reply["usage"]
        assert "client left" not in server.log_tail(4000)  # an answered call is not "cancelled"

    with LocalModelServer(max_tokens_cap=100_000, slots=1) as server:  # one slot: the retry needs it
        url = f"{server.base_url}/chat/completions"
        endless["max_tokens"] = 100_000
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=endless, timeout=3)
        deadline = time.monotonic() + 120
        while "client left; generation stopped" not in server.log_tail(4000):
            assert time.monotonic() < deadline, server.log_tail(2000)
            time.sleep(0.2)
        # the server is free again: a short call is answered, not queued behind 100k tokens
        short = {
            "model": server.alias,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        }
        assert httpx.post(url, json=short, timeout=120).json()["usage"]["completion_tokens"] <= 4


# --------------------------------------------------------------------------- exact token ids
def _vocab_model():
    """llama.cpp on the same .gguf, in this process, for an independent check."""
    import llama_cpp

    return llama_cpp.Llama(model_path=str(find_gguf()), n_ctx=4096, verbose=False, n_threads=2)


def _replay_logprobs(llm, turns) -> list[float]:
    """llama.cpp replaying the episode from the ids the server returned, evaluating them
    in the same pieces the server did (the cached prefix kept, then the turn's new prompt
    tokens in one call, then each completion token): every completion token's logprob.
    (Its logits depend on how a sequence is split into calls, by over a nat for some
    tokens here, so a replay in other pieces would not compare exactly.)"""
    import llama_cpp
    import numpy as np

    out = []
    llm.reset()
    for t in turns:
        llm.n_tokens = t.usage.cached_tokens
        llm.eval(t.prompt_token_ids[t.usage.cached_tokens:])
        for j, tok in enumerate(t.completion_token_ids):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
            lse = logits.max() + np.log(np.exp(logits - logits.max()).sum())
            out.append(float(logits[tok] - lse))
            if j + 1 < len(t.completion_token_ids):
                llm.eval([tok])
    return out


def test_token_ids_from_the_server_rebuild_the_episode_exactly() -> None:
    """return_token_ids as vLLM: the prompt's ids and the completion's ids with logprobs.
    Over a multi-turn tool episode (append-only history) they assemble into ONE exact
    token row, whose completion logprobs llama.cpp reproduces when it reads the row
    itself: the ids are the ones the model saw and sampled, and the cache kept the
    history (each later turn evaluated only its new tokens)."""
    from datetime import UTC, datetime

    from analysis.token_ids import assemble
    from tasks.records import TurnRecord

    with LocalModelServer(max_tokens_cap=64) as server:
        client = ModelClient(ModelConfig(model=server.alias, base_url=server.base_url, max_tokens=40,
                                         temperature=0.8, request_timeout_s=300, logprobs=True,
                                         return_token_ids=True))
        messages = [
            {"role": "system", "content": "You are an agent in a Linux sandbox. Use the tools."},
            {"role": "user", "content": "Write 42 to /testbed/output/answer.txt, then submit."},
        ]
        turns = []
        for i in range(4):
            reply = client.complete(messages, TOOL_SCHEMAS)
            assert reply.prompt_token_ids and reply.completion_token_ids, reply
            assert len(reply.prompt_token_ids) == reply.usage.prompt_tokens
            assert len(reply.completion_logprobs or []) == len(reply.completion_token_ids)
            if i:  # the cache served the history: only the new tokens were evaluated
                assert reply.usage.cached_tokens >= len(turns[-1].prompt_token_ids), reply.usage
            turns.append(TurnRecord(
                run_id="t", episode_id="e", turn_index=i, started_at=datetime.now(UTC),
                assistant_content=reply.content, usage=reply.usage,
                prompt_token_ids=reply.prompt_token_ids, completion_token_ids=reply.completion_token_ids,
                completion_logprobs=reply.completion_logprobs))
            messages.append(reply.as_message())
            for c in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": f"exit code 0 (turn {i})"})
            if not reply.tool_calls:
                messages.append({"role": "user", "content": "Use a tool."})
        llm = _vocab_model()
        tokens = assemble(turns, lambda ids: llm.detokenize(ids).decode("utf-8", "replace"))
        assert tokens.status == "exact", tokens.status
        row = tokens.prompt_ids + tokens.response_ids
        assert row[: len(turns[-1].prompt_token_ids)] == turns[-1].prompt_token_ids
        # the environment's tokens hold every tool result and user message of the episode
        text = llm.detokenize(row).decode()
        assert all(m["content"] in text for m in messages[:-1] if m["role"] in ("tool", "user"))
        forced = _replay_logprobs(llm, turns)
        served = [lp for t in turns for lp in t.completion_logprobs]
        assert served == [lp for lp, m in zip(tokens.response_logprobs, tokens.response_mask, strict=True) if m]
        assert len(forced) == len(served) > 0
        assert max(abs(a - b) for a, b in zip(forced, served, strict=True)) < 1e-3


def test_a_json_schema_request_returns_json_that_validates() -> None:
    """Structured output on the embedded model: the schema is a llama.cpp grammar; a
    schema that cannot be one is a 400 with one sentence, and the server stays up."""
    import httpx
    import jsonschema

    from datagen.questions import TYPES, json_schema

    with LocalModelServer(max_tokens_cap=400) as server:
        url = f"{server.base_url}/chat/completions"
        text = ("Bees communicate the location of flowers through a waggle dance. The angle of the dance "
                "gives the direction relative to the sun and its duration gives the distance.")
        validated = 0
        for qtype in TYPES:
            schema = json_schema(qtype)
            body = {
                "model": server.alias, "temperature": 0.7, "max_tokens": 400, "seed": 3,
                "messages": [{"role": "user", "content": f"Write one {qtype} question about: {text}"}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": qtype, "schema": schema, "strict": True}},
            }
            reply = httpx.post(url, json=body, timeout=300).json()
            choice = reply["choices"][0]
            if choice["finish_reason"] == "length":  # a 135M model may ramble in a string
                continue
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            validated += 1
        assert validated >= 2, "the model ran out of tokens in most replies"
        bad = dict(body, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "^(?!ab)c$"}}})
        r = httpx.post(url, json=bad, timeout=60)
        assert r.status_code == 400 and "cannot become a grammar" in r.json()["error"]["message"], r.text
        assert server.proc is not None and server.proc.poll() is None
        ok = httpx.post(url, json=dict(body, max_tokens=8), timeout=120)
        assert ok.status_code == 200


def test_a_request_waiting_for_the_slot_keeps_its_whole_token_budget() -> None:
    """One slot, two requests at once: the second waits for the first; the wait costs it
    none of its max_tokens, and both get their ids."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    with LocalModelServer(max_tokens_cap=512, slots=1) as server:
        url = f"{server.base_url}/chat/completions"

        def ask(n: int) -> dict:
            body = {"model": server.alias, "max_tokens": n, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Count to {n}."}],
                    "logit_bias": {"0": -100, "2": -100}}  # no end-of-text: it runs to max_tokens
            return httpx.post(url, json=body, timeout=600).json()

        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(ask, 96)
            time.sleep(0.5)
            short = pool.submit(ask, 8)
            replies = [long.result(), short.result()]
        assert [r["usage"]["completion_tokens"] for r in replies] == [96, 8], replies
        assert all(len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"] for r in replies)


def test_two_prompt_families_keep_their_caches() -> None:
    """A run alternates LLM-mode and sandbox-mode episodes: with the default two slots,
    a new sandbox episode's first turn reuses the system prompt and tools the previous
    sandbox episode left in its slot, though an LLM-mode call came in between."""
    import httpx

    def tools_call(task: str) -> dict:
        return {"model": "m", "max_tokens": 4, "temperature": 0, "tools": TOOL_SCHEMAS,
                "messages": [{"role": "system", "content": "You are an agent in a Linux sandbox."},
                             {"role": "user", "content": task}]}

    plain = {"model": "m", "max_tokens": 4, "temperature": 0,
             "messages": [{"role": "user", "content": "What is 2 + 2? " * 40}]}
    with LocalModelServer(max_tokens_cap=64, alias="m") as server:
        assert server.slots == 2
        url = f"{server.base_url}/chat/completions"
        first = httpx.post(url, json=tools_call("Count the files."), timeout=300).json()
        httpx.post(url, json=plain, timeout=300).raise_for_status()
        again = httpx.post(url, json=tools_call("Sum the numbers."), timeout=300).json()
    shared = first["usage"]["prompt_tokens"] - 20  # all but the task's own line and the end
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared, again["usage"]
