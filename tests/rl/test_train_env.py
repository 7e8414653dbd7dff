"""sandflow as TRL's environment (rl/trl_env.py), driven the way GRPOTrainer drives it.

No model here (tests/rl/test_train.py runs the real trainer): the test calls what TRL
calls — `reset(**row)`, the tool calls its parser found (through the per-rollout tool
table `SandflowGRPOTrainer` installs), then the trainer's ids and tool mask — against a
real Docker sandbox from the warm pool and a real warehouse, so records, rewards, masks,
failures and leaks are checked to the token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from analysis.token_ids import assemble
from rl.recording import RolloutTags
from rl.trl_env import RolloutSession, SandflowTRLEnv
from sandbox.base import SandboxConfig, SandboxLimits
from tasks.loop import Limits
from tests.rl.conftest import containers_of, math_task, new_run_id, read_episodes, read_turns
from warehouse.store import Warehouse

pytestmark = pytest.mark.docker


def _session(wh: Path, run_id: str) -> RolloutSession:
    return RolloutSession(
        warehouse=wh,
        sandbox=SandboxConfig(reuse="pool", run_id=run_id,
                              limits=SandboxLimits(network="none", memory_mb=512)),
        limits=Limits(max_steps=8, wall_clock_s=300),
        tags=RolloutTags(training_run="trl-test", step=3, policy_version="trl-test@2"),
        run_id=run_id,
        policy="tiny-policy",
    )


def _call(env: SandflowTRLEnv, name: str, **arguments: Any) -> str:
    """A tool call as SandflowGRPOTrainer routes it (any name, any arguments)."""
    table = env._tool_dict()
    assert name in table
    return table[name](**arguments)


def _decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _close_pool(session: RolloutSession) -> None:
    from sandbox.pool import pool_for

    session.close()
    pool_for(session.sandbox).close()


def test_a_rollout_runs_its_tools_is_scored_by_its_verifier_and_keeps_the_trainers_ids(
    tmp_path: Path,
) -> None:
    run_id = new_run_id("trl-env")
    session = _session(tmp_path, run_id)
    try:
        [row] = session.dataset_rows([math_task()])
        env = session.factory()
        assert env.reset(**row) is None  # the row's prompt is the episode's first messages
        # the task's files are placed as in every episode; an argument the tool does not
        # take ("answer" on execute_bash: the model mixes them) is not a TypeError
        out = _call(env, "execute_bash", command="cat /testbed/documents/notes.txt", answer="x")
        assert "multiply" in out
        assert "Unknown tool 'python'" in _call(env, "python", code="print(1)")
        assert "`command`" in _call(env, "execute_bash")  # one clear observation, no crash
        assert _call(env, "submit", answer="42") == "Submitted."
        assert _call(env, "execute_bash", command="echo late").startswith("Not executed")

        # what TRL trained on: prompt, then policy / tool segments (mask 1 / 0)
        prompt = list(range(1000, 1012))
        segs = [([1, 2, 3], 1), ([50, 51], 0), ([4, 5], 1), ([52], 0), ([6], 1), ([53], 0),
                ([7, 8], 1), ([54, 55], 0), ([9, 9, 9], 1)]  # the last: after submit
        completion = [t for ids, _ in segs for t in ids]
        mask = [m for ids, m in segs for _ in ids]
        calls = [{"type": "function", "function": {"name": n, "arguments": {}}}
                 for n in ("execute_bash", "python", "execute_bash", "submit")]
        completions = [
            {"role": "assistant", "content": "", "tool_calls": [calls[0]]},
            {"role": "tool", "name": "execute_bash", "content": out},
            {"role": "assistant", "content": "", "tool_calls": [calls[1]]},
            {"role": "tool", "name": "python", "content": "..."},
            {"role": "assistant", "content": "", "tool_calls": [calls[2]]},
            {"role": "tool", "name": "execute_bash", "content": "..."},
            {"role": "assistant", "content": "", "tool_calls": [calls[3]]},
            {"role": "tool", "name": "submit", "content": "Submitted."},
            {"role": "assistant", "content": "more"},
        ]
        trained = list(mask)
        env._trained_on(prompt, completion, trained, completions, None, _decode, False)
        # the tokens after the episode's end (after submit) are not trained
        assert trained == mask[: len(mask) - 3] + [0, 0, 0]
        assert env.get_reward() == 1.0
        assert session.times.rollouts == 1 and session.times.dropped == 0
    finally:
        _close_pool(session)

    [ep] = read_episodes(tmp_path, run_id)
    assert ep["termination"] == "submitted" and ep["answer"] == "42"
    assert (ep["training_run"], ep["training_step"], ep["policy_version"]) == ("trl-test", 3, "trl-test@2")
    assert ep["token_ids_status"] == "exact"
    with Warehouse(tmp_path).query() as q:
        [(score, verifier)] = q.sql(
            f"SELECT score, verifier FROM episode_score WHERE run_id = '{run_id}'").fetchall()
    assert score == 1.0 and verifier == "exact"
    # the warehouse's trajectory is the trainer's: same prompt, same trained tokens
    _, turns = Warehouse(tmp_path).episode(run_id, ep["episode_id"])  # type: ignore[misc]
    traj = assemble(turns)
    assert traj.prompt_ids == prompt
    n = len(traj.response_ids or [])
    assert traj.response_ids == completion[:n] and traj.response_mask == trained[:n]
    assert [t for t, m in zip(completion, trained, strict=True) if m] == [
        t for t, m in zip(traj.response_ids or [], traj.response_mask or [], strict=True) if m]
    assert [t["assistant_content"] for t in read_turns(tmp_path, run_id)][0] == "t1 t2 t3"
    assert containers_of(run_id) == []  # given back to the pool, and the pool closed


def test_a_turn_without_a_tool_call_ends_the_rollout_and_is_recorded(tmp_path: Path) -> None:
    run_id = new_run_id("trl-env-text")
    session = _session(tmp_path, run_id)
    try:
        [row] = session.dataset_rows([math_task()])
        env = session.factory()
        env.reset(**row)
        prompt, completion = [7, 7, 7], [11, 12, 13]
        trained = [1, 1, 1]
        env._trained_on(prompt, completion, trained, [{"role": "assistant", "content": "42"}],
                        None, lambda ids: "42", False)
        assert trained == [1, 1, 1] and env.get_reward() == 1.0  # the last message's answer
    finally:
        _close_pool(session)
    [ep] = read_episodes(tmp_path, run_id)
    assert ep["termination"] == "max_steps" and ep["token_ids_status"] == "exact"
    [turn] = read_turns(tmp_path, run_id)
    assert turn["extra_messages"] in (None, [], "[]")  # no nudge the model never saw


def test_a_broken_sandbox_drops_the_rollout_never_a_zero_reward(tmp_path: Path) -> None:
    run_id = new_run_id("trl-env-infra")
    session = _session(tmp_path, run_id)
    try:
        [row] = session.dataset_rows([math_task()])
        env = session.factory()
        env.reset(**row)
        for c in containers_of(run_id):
            c.kill()  # the engine lost the container mid-rollout
        out = _call(env, "execute_bash", command="echo hi")
        assert "infrastructure" in out
        trained = [1, 1, 0, 1]
        completions = [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "execute_bash", "arguments": {}}}]},
            {"role": "tool", "name": "execute_bash", "content": out},
            {"role": "assistant", "content": "x"},
        ]
        env._trained_on([1], [5, 6, 60, 7], trained, completions, None, _decode, False)
        assert trained == [0, 0, 0, 0]  # no token of it is trained
        assert env.get_reward() is None  # TRL: unscorable, no advantage
        assert session.dropped_total == 1
    finally:
        _close_pool(session)
    [ep] = read_episodes(tmp_path, run_id)
    assert ep["termination"] == "sandbox_error" and ep["is_infra_failure"]
    with Warehouse(tmp_path).query() as q:
        assert q.sql(f"SELECT count(*) FROM scores WHERE run_id = '{run_id}'").fetchall() == [(0,)]


def test_stopping_training_records_open_rollouts_interrupted_and_leaves_no_sandbox(
    tmp_path: Path,
) -> None:
    run_id = new_run_id("trl-env-stop")
    session = _session(tmp_path, run_id)
    [row] = session.dataset_rows([math_task()])
    envs = [session.factory() for _ in range(2)]
    for env in envs:
        env.reset(**row)
    _call(envs[0], "execute_bash", command="sleep 0.1")
    assert len(containers_of(run_id)) >= 2
    _close_pool(session)  # what train() does on Ctrl+C
    eps = read_episodes(tmp_path, run_id)
    assert sorted(e["termination"] for e in eps) == ["interrupted", "interrupted"]
    assert containers_of(run_id) == []


def test_a_row_whose_prompt_is_not_the_episodes_is_refused(tmp_path: Path) -> None:
    run_id = new_run_id("trl-env-prompt")
    session = _session(tmp_path, run_id)
    try:
        [row] = session.dataset_rows([math_task()])
        row["prompt"] = [{"role": "user", "content": "something else"}]
        with pytest.raises(ValueError, match="prompt"):
            session.factory().reset(**row)
    finally:
        _close_pool(session)
    assert containers_of(run_id) == []


def test_tool_results_trl_drops_as_overlong_end_the_rollout_as_context_exhausted(tmp_path: Path) -> None:
    run_id = new_run_id("trl-env-overlong")
    session = _session(tmp_path, run_id)
    try:
        [row] = session.dataset_rows([math_task()])
        env = session.factory()
        env.reset(**row)
        _call(env, "execute_bash", command="echo 42")  # ran, but TRL rolled its result back
        trained = [1, 1, 1]
        completions = [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "execute_bash", "arguments": {}}}]}]
        env._trained_on([1], [5, 6, 7], trained, completions, None, _decode, False)
        assert trained == [1, 1, 1]
        assert env.get_reward() == 0.0  # no answer: the model's doing, scored
    finally:
        _close_pool(session)
    [ep] = read_episodes(tmp_path, run_id)
    assert ep["termination"] == "context_exhausted" and "dropped the last tool results" in ep["error"]
