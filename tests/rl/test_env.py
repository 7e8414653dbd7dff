"""The step-wise environment against a real sandbox and a real warehouse.

The policy's turns are written by the test (as a trainer would generate them), in both
accepted forms: raw text with Hermes `<tool_call>` blocks, and OpenAI assistant messages.
Token ids come from tests/scripted_model.ToyTokenizer, exactly as a vLLM server would
return them, so the recorded ids can be checked to the token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rl.env import InfraError, SandboxEnv
from rl.recording import RolloutTags
from tasks.loop import Limits
from tests.rl.conftest import (
    WRITE_ANSWER,
    math_task,
    new_run_id,
    read_episodes,
    read_turns,
    sandbox_cfg,
)
from tests.scripted_model import ToyTokenizer


def hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_raw_text_and_openai_turns_reward_and_warehouse_tags(tmp_path: Path) -> None:
    run_id = new_run_id("env")
    tags = RolloutTags(training_run="grpo-7", step=12, policy_version="v12")
    env = SandboxEnv(
        sandbox=sandbox_cfg(),
        warehouse=tmp_path,
        tags=tags,
        run_id=run_id,
        durability="flush",
        policy="qwen-test",
    )
    task = math_task()
    first = env.reset(task)
    assert [m["role"] for m in first] == ["system", "user"]
    assert task.problem_statement in first[1]["content"]
    assert "/testbed/documents/notes.txt" in first[1]["content"]

    # 1. raw text, two calls in one turn, with reasoning first
    text = (
        "<think>compute it</think>Let me look.\n"
        + hermes("execute_bash", {"command": "cat /testbed/documents/notes.txt"})
        + "\n"
        + hermes("execute_bash", WRITE_ANSWER)
    )
    out = env.step(text)
    assert not out.done and out.reward == 0.0
    assert [m["role"] for m in out.observations] == ["tool", "tool"]
    assert [m["tool_call_id"] for m in out.observations] == ["call_0_0", "call_0_1"]
    assert out.observations[0]["content"] == "multiply\n[exit code: 0]"
    assert out.observations[1]["content"] == "[exit code: 0]"

    # 2. prose without a tool call: the loop's nudge
    out = env.step("I think I am done.")
    assert not out.done
    assert [m["role"] for m in out.observations] == ["user"]
    assert "did not call a tool" in out.observations[0]["content"]

    # 3. an OpenAI message with a structured call
    out = env.step(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "submit", "arguments": "{}"}}
            ],
        }
    )
    assert out.done and out.reward == 1.0
    assert out.observations == [{"role": "tool", "tool_call_id": "c9", "content": "Submitted."}]
    assert out.info["termination"] == "submitted" and out.info["answer"] == "42"
    env.close()

    [ep] = read_episodes(tmp_path, run_id)
    assert (ep["training_run"], ep["training_step"], ep["policy_version"]) == ("grpo-7", 12, "v12")
    assert ep["termination"] == "submitted" and ep["answer"] == "42" and ep["num_turns"] == 3
    assert ep["model"] == "qwen-test" and ep["token_ids_status"] == "missing"
    from warehouse.store import Warehouse

    kept = Warehouse(tmp_path).run_tasks(run_id)  # the run keeps the task it ran
    assert kept is not None and [t.content_hash for t in kept] == [task.content_hash]
    with Warehouse(tmp_path).query(run_id=run_id) as q:
        assert q.rows("SELECT score, verifier FROM scores") == [(1.0, "exact")]
        assert q.rows(  # the score names the attempt it judged
            "SELECT s.episode_write_id = e.write_id FROM scores s JOIN episodes e USING (episode_id)"
        ) == [(True,)]
        assert q.rows(
            "SELECT training_run, training_step, episodes, mean_reward, avg_turns FROM rl_steps"
        ) == [("grpo-7", 12, 1, 1.0, 3.0)]
    turns = read_turns(tmp_path, run_id)
    assert turns[0]["assistant_content"] == text  # the text exactly as generated
    assert [c["name"] for c in turns[0]["tool_calls"]] == ["execute_bash", "execute_bash"]
    assert turns[0]["reasoning_content"] == "compute it"
    assert json.loads(turns[1]["extra_messages"])[0]["role"] == "user"
    # the env's history is the policy's own text (no re-rendered tool calls)
    assert env.episode is not None
    assert env.episode.messages[2] == {"role": "assistant", "content": text}


def test_token_ids_recorded_exactly_or_the_episode_says_why(tmp_path: Path) -> None:
    run_id = new_run_id("env-tokens")
    for drop_reasoning, expect in ((False, "exact"), (True, "mismatch at turn 1")):
        tok = ToyTokenizer(drop_reasoning=drop_reasoning)
        env = SandboxEnv(
            sandbox=sandbox_cfg(),
            warehouse=tmp_path,
            run_id=run_id,
            durability="flush",
            tags=RolloutTags(training_run="t", step=1, policy_version="p"),
        )
        history = env.reset(math_task())
        turns = ["<think>a</think>" + hermes("execute_bash", WRITE_ANSWER), hermes("submit", {})]
        sent = []
        for text in turns:
            prompt = tok.render(history)
            completion = tok.completion(text, [])
            lps = [tok.logprob(t, i) for i, t in enumerate(completion)]
            out = env.step(
                text, prompt_token_ids=prompt, completion_token_ids=completion, logprobs=lps
            )
            sent.append((prompt, completion, lps))
            history = [*history, {"role": "assistant", "content": text}, *out.observations]
        assert out.done and out.reward == 1.0
        ep = next(
            e for e in read_episodes(tmp_path, run_id) if e["episode_id"] == out.info["episode_id"]
        )
        assert ep["token_ids_status"].startswith(expect), ep["token_ids_status"]
        stored = [t for t in read_turns(tmp_path, run_id) if t["episode_id"] == ep["episode_id"]]
        assert [
            (t["prompt_token_ids"], t["completion_token_ids"], t["completion_logprobs"])
            for t in stored
        ] == [(p, c, lp) for p, c, lp in sent]
        assert [t["prompt_tokens"] for t in stored] == [len(p) for p, _, _ in sent]


def test_limits_end_the_episode_with_their_reason(tmp_path: Path) -> None:
    env = SandboxEnv(
        sandbox=sandbox_cfg(),
        limits=Limits(max_steps=2, max_observation_chars=300),
        run_id=new_run_id("env-limits"),
    )
    env.reset(math_task())
    out = env.step(hermes("execute_bash", {"command": "yes abcdefgh | head -c 5000"}))
    assert not out.done
    assert (
        len(out.observations[0]["content"]) < 400
        and "<response clipped" in out.observations[0]["content"]
    )
    out = env.step("still thinking")
    assert out.done and out.info["termination"] == "max_steps"
    assert out.reward == 0.0 and out.info["reward_reason"]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("more")
    env.close()


def test_infra_failure_raises_and_is_recorded_not_scored(tmp_path: Path) -> None:
    run_id = new_run_id("env-infra")
    env = SandboxEnv(sandbox=sandbox_cfg(), warehouse=tmp_path, run_id=run_id, durability="flush")
    env.reset(math_task())
    assert env.episode is not None and env.episode.sandbox is not None
    env.episode.sandbox.kill()  # type: ignore[attr-defined]  # the engine lost the container
    with pytest.raises(InfraError, match="sandbox_error"):
        env.step(hermes("execute_bash", {"command": "echo hi"}))
    [ep] = read_episodes(tmp_path, run_id)
    assert ep["termination"] == "sandbox_error" and ep["is_infra_failure"]


def test_bad_actions_and_rows_are_clear_errors() -> None:
    from datasets_prep.rows import RowError
    from rl.toolcalls import ActionError

    env = SandboxEnv(sandbox=sandbox_cfg(), run_id=new_run_id("env-bad"))
    with pytest.raises(RowError, match="problem_statement"):
        env.reset({"extra_info": {"id": "x", "domain": "math", "ground_truth": "1"}})
    env.reset(math_task())
    with pytest.raises(ActionError, match="role 'user'"):
        env.step({"role": "user", "content": "hi"})
    with pytest.raises(ActionError, match="logprobs"):
        env.step("x", completion_token_ids=[1, 2], logprobs=[0.0])
    out = env.step(hermes("submit", {}))
    assert out.done
    env.close()


def test_wall_clock_counts_the_policys_time_between_steps() -> None:
    import time

    env = SandboxEnv(
        sandbox=sandbox_cfg(), limits=Limits(wall_clock_s=1.0), run_id=new_run_id("env-clock")
    )
    env.reset(math_task())  # opening the sandbox is not the policy's time
    out = env.step(hermes("execute_bash", {"command": "true"}))
    assert not out.done
    time.sleep(1.2)  # the trainer generates slowly
    out = env.step(hermes("execute_bash", {"command": "echo late"}))
    assert out.done and out.info["termination"] == "wall_clock"
    env.close()


def test_a_step_with_3000_tool_calls_runs_the_cap_and_answers_every_call() -> None:
    """Issue #22.9: one step with 3,000 calls produced 48 MB of observations in 15.6 s. Now
    `max_tool_calls_per_turn` of them run (here 32, the default); each of the others is
    answered with a short error, so the trainer gets one tool message per call."""
    env = SandboxEnv(sandbox=sandbox_cfg(), run_id=new_run_id("calls"))
    env.reset(math_task())
    call = hermes("execute_bash", {"command": "echo x >> /tmp/ran; head -c 1000 /dev/zero | tr '\\0' a"})
    out = env.step("\n".join([call] * 3000))
    assert not out.done
    assert len(out.observations) == 3000
    assert [m["tool_call_id"] for m in out.observations] == [f"call_0_{i}" for i in range(3000)]
    cap = Limits().max_tool_calls_per_turn
    assert cap == 32
    refused = [m for m in out.observations if m["content"].startswith("Not executed")]
    assert len(refused) == 3000 - cap
    total = sum(len(m["content"].encode()) for m in out.observations)
    budget = Limits().max_observation_bytes_per_turn
    assert total < budget + 200 * 3000, total  # bounded: the budget plus one short line per call
    turn = env.episode.turns[-1] if env.episode else None
    assert turn is not None and len(turn.observations) == 3000
    ran = env.step(hermes("execute_bash", {"command": "wc -l < /tmp/ran"}))
    assert ran.observations[0]["content"] == f"{cap}\n[exit code: 0]"
    env.close()


def test_a_step_over_the_byte_budget_stops_running_calls() -> None:
    """Issue #22.9, the byte bound through SandboxEnv: with a 4,000-byte budget, a call that
    prints 3,000 bytes runs, the next is clipped to the bytes left, the rest do not run."""
    env = SandboxEnv(
        sandbox=sandbox_cfg(),
        run_id=new_run_id("bytes"),
        limits=Limits(max_observation_bytes_per_turn=4000),
    )
    env.reset(math_task())
    call = hermes("execute_bash", {"command": "echo x >> /tmp/ran; head -c 3000 /dev/zero | tr '\\0' a"})
    out = env.step("\n".join([call] * 5))
    contents = [m["content"] for m in out.observations]
    assert len(contents) == 5
    assert "bytes omitted, this message's tool results reached 4000 bytes" in contents[1]
    assert all(c.startswith("Not executed: this message's tool results reached 4000 bytes") for c in contents[2:])
    ran = env.step(hermes("execute_bash", {"command": "wc -l < /tmp/ran"}))
    assert ran.observations[0]["content"] == "2\n[exit code: 0]"
    env.close()


def test_a_chem_symbol_row_scores_its_correct_answer() -> None:
    """Issue #22: through the RL rows a list ground truth became its JSON text, and every
    chem "symbol" task scored 0 in SandboxEnv for a correct answer. The row the export
    writes (datasets_prep.rows.task_rows) drives the real reward path here."""
    import random

    from analysis.rollouts import sandbox_prompt
    from datasets_prep.rows import task_rows
    from datasets_prep.suites import chem

    task = chem.element_symbol(random.Random(5), 0)
    symbol, name = task.ground_truth
    [row] = task_rows([task], sandbox_prompt)
    env = SandboxEnv(sandbox=sandbox_cfg(), run_id=new_run_id("env-chem"))
    for answer, reward in ((symbol, 1.0), (name.upper(), 1.0), ("Xx", 0.0)):
        env.reset(row)
        assert env.task is not None and env.task.ground_truth == [symbol, name]
        env.step(hermes("execute_bash", {"command": f"echo {answer} > /testbed/output/answer.txt"}))
        out = env.step(hermes("submit", {}))
        assert out.done and out.reward == reward, (answer, out.info.get("reward_reason"))
    env.close()


def test_fork_gives_k_envs_that_share_the_history_and_branch_apart(tmp_path: Path) -> None:
    """SandboxEnv.fork(k) (issue #25): the children have the parent's messages, turn count
    and prefix token ids, its files and shell state, each in its own sandbox; they go on
    apart (different answers, different rewards) and are recorded with their lineage."""
    run_id = new_run_id("env-fork")
    tok = ToyTokenizer()
    env = SandboxEnv(sandbox=sandbox_cfg(), warehouse=tmp_path, run_id=run_id, durability="flush")
    history = env.reset(math_task())

    def step(e: SandboxEnv, hist: list, text: str) -> tuple[list, Any]:
        prompt, completion = tok.render(hist), tok.completion(text, [])
        lps = [tok.logprob(t, i) for i, t in enumerate(completion)]
        out = e.step(text, prompt_token_ids=prompt, completion_token_ids=completion, logprobs=lps)
        return [*hist, {"role": "assistant", "content": text}, *out.observations], out

    shape = "echo 4 > /tmp/part; export HALF=2; cd /testbed/output; sleep 600 &"
    history, _ = step(env, history, hermes("execute_bash", {"command": shape}))
    a, b = env.fork(2)
    assert env.messages == a.messages == b.messages == history
    assert a.episode is not None and b.episode is not None and env.episode is not None
    assert len(a.episode.turns) == len(b.episode.turns) == 1
    ids = lambda e: [(t.prompt_token_ids, t.completion_token_ids) for t in e.episode.turns]  # noqa: E731
    assert ids(a) == ids(b) == ids(env) and ids(a)[0][0]
    assert a.fork_info is not None and a.fork_info.process_count == 1  # the sleep: not carried
    finals = {}
    for e, write in ((a, "$(cat /tmp/part)$HALF"), (b, "41"), (env, "40")):
        cmd = f'[ "$PWD" = /testbed/output ] && echo {write} > answer.txt'
        hist, _ = step(e, history, hermes("execute_bash", {"command": cmd}))
        _, out = step(e, hist, hermes("submit", {}))
        assert out.done
        finals[out.info["episode_id"]] = out.reward
    parent_id = env.episode.record.episode_id
    assert sorted(finals.values()) == [0.0, 0.0, 1.0]
    assert finals[a.episode.record.episode_id] == 1.0  # a saw the parent's file, var and cwd
    eps = {e["episode_id"]: e for e in read_episodes(tmp_path, run_id)}
    assert set(eps) == set(finals)
    for child in (a, b):
        row = eps[child.episode.record.episode_id]
        assert (row["parent_episode_id"], row["branch_turn"], row["branch_kind"]) == (
            parent_id,
            1,
            "fork",
        )
        assert row["num_turns"] == 3 and row["token_ids_status"] == "exact"
    assert eps[parent_id]["parent_episode_id"] is None
    stored = [t for t in read_turns(tmp_path, run_id) if t["turn_index"] == 0]
    assert len({(tuple(t["prompt_token_ids"]), tuple(t["completion_token_ids"])) for t in stored}) == 1
