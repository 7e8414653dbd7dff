"""The rollout server over real HTTP: scripted policies with vLLM-style token ids, real
sandboxes, a real warehouse. Masks, ids, logprobs, rewards and advantages are checked
exactly; a trainer that disconnects leaves no sandbox."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rl.client import RolloutClient, RolloutServerError
from tests.rl.conftest import (
    containers_of,
    math_task,
    new_run_id,
    read_episodes,
    rollout_server,
    status_of,
)
from tests.scripted_model import Fault, Reply, ScriptedModel, ToyTokenizer, tool_reply


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    with rollout_server(tmp_path / "wh") as (url, _):
        yield url


def answering(answers: Iterator[str], command: str = "") -> Any:
    """Turn 1: write the next answer of `answers`; turn 2: submit."""
    lock = threading.Lock()

    def reply(body: dict, index: int) -> Reply | Fault:
        done = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        if done == 0:
            with lock:
                answer = next(answers)
            cmd = f"{command}echo {answer} > /testbed/output/answer.txt"
            return tool_reply("execute_bash", {"command": cmd}, content="Computing.")
        return tool_reply("submit", {})

    return reply


def request(model: ScriptedModel, run_id: str, n: int = 4, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "tasks": [math_task().model_dump()],
        "n": n,
        "endpoint": {"base_url": model.url, "model": "scripted", "max_retries": 0},
        "sampling": {"temperature": 1.0, "max_tokens": 256},
        "training_run": "grpo-test",
        "step": 3,
        "policy_version": "v3",
        "run_id": run_id,
    }
    body.update(kw)
    return body


def check_tokens(t: dict[str, Any], tok: ToyTokenizer) -> None:
    """The ids are the conversation's own tokens; mask and logprobs exactly on the completions."""
    msgs = t["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    assert t["token_ids_status"] == "exact"
    assert t["prompt_ids"] == tok.render(msgs[:2])
    assert t["prompt_ids"] + t["response_ids"] + tok.text_ids("\n") == tok.render(
        msgs[: last + 1], False
    )
    completions = [
        tok.completion(m.get("content"), m.get("tool_calls") or [])
        for m in msgs[2 : last + 1]
        if m["role"] == "assistant"
    ]
    got_mask, got_lps = t["response_mask"], t["response_logprobs"]
    assert len(got_mask) == len(got_lps) == len(t["response_ids"])
    # mask 1 exactly on each completion, logprobs the server's; environment tokens 0 / 0.0
    assert sum(got_mask) == sum(len(c) for c in completions)
    assert [lp for lp, k in zip(got_lps, got_mask, strict=True) if k == 1] == [
        tok.logprob(x, i) for c in completions for i, x in enumerate(c)
    ]
    assert all(lp == 0.0 for lp, k in zip(got_lps, got_mask, strict=True) if k == 0)
    assert [t["response_ids"][a:b] for a, b in _spans(got_mask)] == completions


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, k in enumerate([*mask, 0]):
        if k and start is None:
            start = i
        elif not k and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("raw_text", [False, True], ids=["tool-parser", "raw-text"])
def test_batch_streams_exact_trajectories_rewards_and_advantages(
    server: str, tmp_path: Path, raw_text: bool
) -> None:
    tok = ToyTokenizer()
    answers = itertools.cycle(["42", "41"])
    run_id = new_run_id("srv")
    with (
        ScriptedModel(default=answering(answers), tokenizer=tok, raw_tool_calls=raw_text) as model,
        RolloutClient(server) as client,
    ):
        result = client.rollouts(request(model, run_id))
    assert result.summary["episodes"] == 4 and result.summary["ok"] == 4
    assert result.run_id == run_id and len(result.groups) == 1
    by_reward = sorted(result.trajectories, key=lambda t: t["reward"])
    assert [t["reward"] for t in by_reward] == [0.0, 0.0, 1.0, 1.0]
    assert [round(t["advantage_rloo"], 6) for t in by_reward] == [
        -0.666667,
        -0.666667,
        0.666667,
        0.666667,
    ]
    assert [round(t["advantage_grpo"], 4) for t in by_reward] == [-0.866, -0.866, 0.866, 0.866]
    for t in result.trajectories:
        assert t["status"] == "ok" and t["termination"] == "submitted" and t["num_turns"] == 2
        assert [m["role"] for m in t["messages"]] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
        ]
        assert t["loss_mask"] == [0, 0, 1, 0, 1, 0]
        if raw_text:  # the history keeps the text as generated, no structured calls
            assert (
                "<tool_call>" in t["messages"][2]["content"]
                and "tool_calls" not in t["messages"][2]
            )
        check_tokens(t, tok)
        assert (t["training_run"], t["step"], t["policy_version"]) == ("grpo-test", 3, "v3")
    eps = read_episodes(tmp_path / "wh", run_id)
    assert len(eps) == 4
    assert {
        (e["training_run"], e["training_step"], e["policy_version"], e["token_ids_status"])
        for e in eps
    } == {("grpo-test", 3, "v3", "exact")}
    from warehouse.store import Warehouse

    scores = Warehouse(tmp_path / "wh").scores(run_id).to_pylist()
    assert sorted(s["score"] for s in scores) == [0.0, 0.0, 1.0, 1.0]
    kept = Warehouse(tmp_path / "wh").run_tasks(run_id)  # the batch keeps the tasks it ran
    assert kept is not None and [t.content_hash for t in kept] == [math_task().content_hash]
    # the run ended by the engine's rules (engine.run.RunHandle): every episode ran
    assert status_of(tmp_path / "wh", run_id) == "finished"
    wh = Warehouse(tmp_path / "wh")
    with wh.query(run_id=run_id) as q:
        assert q.rows("SELECT accuracy FROM accuracy") == [(0.5,)]
        # each score names the recording attempt it judged, like any scored run's
        assert q.rows(
            "SELECT count(*), count(*) FILTER (WHERE s.episode_write_id = e.write_id) "
            "FROM scores s JOIN episodes e USING (run_id, episode_id)"
        ) == [(4, 4)]
        assert q.rows(
            "SELECT training_run, training_step, policy_version, episodes, infra_failures, mean_reward,"
            " avg_turns, tool_calls_per_turn, submitted_rate, exact_token_rate FROM rl_steps"
        ) == [("grpo-test", 3, "v3", 4, 0, 0.5, 2.0, 1.0, 1.0, 1.0)]
    # capability usage by training step (labels as the usage flow writes them)
    wh.write_usage(
        [
            {
                "run_id": run_id,
                "episode_id": e["episode_id"],
                "turn_index": 0,
                "call_index": 0,
                "capability": "file_management",
                "tool": "execute_bash",
                "labeler": "rules-v1",
            }
            for e in eps
        ]
    )
    with wh.query(run_id=run_id) as q:
        assert q.rows(
            "SELECT training_step, capability, turns_with_capability, turns, rate FROM rl_capability_usage"
        ) == [(3, "file_management", 4, 8, 0.5)]


def test_infra_failures_are_retried_and_never_a_zero_reward(server: str, tmp_path: Path) -> None:
    run_id = new_run_id("srv-infra")
    inner = answering(itertools.repeat("42"))
    calls = itertools.count()

    def flaky(body: dict, index: int) -> Reply | Fault:
        text = body["messages"][1]["content"]
        if "always-broken" in text:
            return Fault.server_error(500)
        if next(calls) == 0:
            return Fault.server_error(503)  # the first episode's first call: retried
        return inner(body, index)

    broken = math_task("always-broken").model_copy(
        update={"problem_statement": "always-broken: what is 6*7?"}
    )
    with ScriptedModel(default=flaky) as model, RolloutClient(server) as client:
        body = request(model, run_id, n=2, episode_attempts=2)
        body["tasks"].append(broken.model_dump())
        result = client.rollouts(body)
    good = [t for t in result.trajectories if t["task_id"] == "six-times-seven"]
    bad = [t for t in result.trajectories if t["task_id"] == "always-broken"]
    assert [t["reward"] for t in good] == [1.0, 1.0] and sorted(t["attempts"] for t in good) == [
        1,
        2,
    ]
    assert [(t["status"], t["reward"], t["termination"]) for t in bad] == [
        ("failed", None, "model_error")
    ] * 2
    assert [t["attempts"] for t in bad] == [2, 2]
    group = next(g for g in result.groups if g["task_id"] == "always-broken")
    assert group["size"] == 0 and group["failed"] == 2 and group["rewards"] == []
    assert result.summary["failed"] == 2 and result.summary["ok"] == 2
    # the engine's rules (engine.run.RunHandle, as `engine.run`): episodes that failed
    # after their retries fail the run, and its record says how many
    from warehouse.store import Warehouse

    assert status_of(tmp_path / "wh", run_id) == "failed"
    assert Warehouse(tmp_path / "wh").run_info(run_id)["notes"] == "2 episodes failed"


def test_disconnect_cancels_the_batch_and_leaves_no_sandbox(server: str, tmp_path: Path) -> None:
    run_id = new_run_id("srv-cut")
    answers = itertools.repeat("42")
    with ScriptedModel(default=answering(answers, command="sleep 60; ")) as model:
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", f"{server}/v1/rollouts", json=request(model, run_id)) as resp,
        ):
            lines = resp.iter_lines()
            assert '"type":"start"' in next(lines)
            assert model.wait_for_requests(4, timeout=60)  # all four are in their sleep
            deadline = time.monotonic() + 30
            while len(containers_of(run_id)) < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(containers_of(run_id)) == 4
        # the response is closed: the trainer is gone
        deadline = time.monotonic() + 30
        while containers_of(run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert containers_of(run_id) == []
    deadline = time.monotonic() + 30
    eps: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        eps = read_episodes(tmp_path / "wh", run_id)
        if len(eps) == 4:
            break
        time.sleep(0.2)
    assert sorted(e["termination"] for e in eps) == ["interrupted"] * 4
    assert len(model.requests) == 4  # no episode went on to its second turn
    with RolloutClient(server) as client:
        assert client.health()["active_batches"] == 0


def test_bad_requests_are_clear_errors(server: str) -> None:
    with RolloutClient(server) as client:
        with pytest.raises(RolloutServerError, match="422.*problem_statement"):
            list(
                client.stream(
                    {
                        "tasks": [{"extra_info": {"id": "x", "domain": "math"}}],
                        "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
                    }
                )
            )
        with pytest.raises(RolloutServerError, match="422.*endpoint"):
            list(client.stream({"tasks": [math_task().model_dump()]}))
        with pytest.raises(RolloutServerError, match="422.*run_id"):
            list(
                client.stream(
                    {
                        "tasks": [math_task().model_dump()],
                        "run_id": "../etc",
                        "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
                    }
                )
            )
        # a misspelt key is refused by name, not run with the default in its place
        endpoint = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}
        for part, body in (("sampling", {"temprature": 0.2}), ("endpoint", {**endpoint, "timeout": 5})):
            with pytest.raises(RolloutServerError, match=rf"422.*{part}.*{next(iter(body.keys() - endpoint.keys()))}"):
                list(client.stream({"tasks": [math_task().model_dump()], "endpoint": endpoint, part: body}))


def test_the_endpoint_key_is_used_and_never_recorded(server: str, tmp_path: Path) -> None:
    import json

    key = "sk-test-SECRET-4242"
    run_id = new_run_id("srv-key")
    with (
        ScriptedModel(default=answering(itertools.repeat("42"))) as model,
        RolloutClient(server) as client,
    ):
        body = request(model, run_id, n=1)
        body["endpoint"]["api_key"] = key
        result = client.rollouts(body)
        assert {h.get("authorization") for h in model.headers} == {f"Bearer {key}"}
    assert result.summary["ok"] == 1
    assert key not in json.dumps(result.trajectories)
    from warehouse.store import Warehouse

    with Warehouse(tmp_path / "wh").query(run_id=run_id) as q:
        dumped = json.dumps(
            [
                q.rows("SELECT * FROM runs"),
                q.rows("SELECT * FROM episodes"),
                q.rows("SELECT * FROM turns"),
            ],
            default=str,
        )
    assert key not in dumped and run_id in dumped
