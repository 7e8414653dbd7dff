"""The SkyRL adapter against the real `skyrl_gym` package, driven as SkyRL's generator does:
make(env_class, env_config=DictConfig, extras=row) -> init(prompt) -> step(text)... -> close()."""

from __future__ import annotations

import json
from pathlib import Path

import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.envs.base_text_env import BaseTextEnv

from rl.skyrl import register
from tests.rl.conftest import WRITE_ANSWER, math_task, new_run_id, read_episodes


def _row() -> dict:
    """A dataset row as `sandflow flows rollouts` writes it (and SkyRL passes as extras)."""
    from analysis.rollouts import sandbox_prompt
    from datasets_prep.rows import task_rows

    [row] = task_rows([math_task()], sandbox_prompt)
    return row


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_skyrl_generator_drives_an_episode_to_its_reward(tmp_path: Path) -> None:
    env_id = register()
    run_id = new_run_id("skyrl")
    cfg = OmegaConf.create(
        {
            "warehouse": str(tmp_path),
            "run_id": run_id,
            "training_run": "skyrl-run",
            "policy_version": "w3",
            "sandbox": {"limits": {"network": "none", "memory_mb": 512}},
        }
    )
    row = _row()
    extras = {k: v for k, v in row.items() if k != "prompt"} | {"max_turns": 5, "training_step": 4}
    env = skyrl_gym.make(env_id, env_config=cfg, extras=extras)
    assert isinstance(env, BaseTextEnv)
    chat, meta = env.init(row["prompt"])
    assert chat == row["prompt"] and meta["episode_id"]
    out = env.step(_call("execute_bash", WRITE_ANSWER))
    assert out["done"] is False and out["reward"] == 0.0
    assert out["observations"][0]["role"] == "tool"
    out = env.step(_call("submit", {}))
    assert out["done"] is True and out["reward"] == 1.0
    assert env.get_metrics() == {"turns": 2, "reward": 1.0, "submitted": 1.0}
    env.close()
    [ep] = read_episodes(tmp_path, run_id)
    assert (ep["training_run"], ep["training_step"], ep["policy_version"]) == ("skyrl-run", 4, "w3")
    assert ep["termination"] == "submitted" and ep["task_id"] == "six-times-seven"


def test_skyrl_length_stop_is_context_exhausted_and_max_turns_caps_steps(tmp_path: Path) -> None:
    env_id = register()
    run_id = new_run_id("skyrl-len")
    cfg = {"warehouse": str(tmp_path), "run_id": run_id, "sandbox": {"limits": {"network": "none"}}}
    extras = {k: v for k, v in _row().items() if k != "prompt"} | {"max_turns": 2}
    env = skyrl_gym.make(env_id, env_config=cfg, extras=extras)
    assert env.max_turns == 2
    env.init([])
    env.step("no tool call here")
    env.close()  # SkyRL's generator stopped at max_input_length
    env2 = skyrl_gym.make(env_id, env_config=cfg, extras=extras)
    env2.init([])
    env2.step("thinking")
    out = env2.step("still thinking")
    assert out["done"] and out["metadata"]["termination"] == "max_steps"
    env2.close()
    eps = sorted(read_episodes(tmp_path, run_id), key=lambda e: e["sample_index"])
    assert [e["termination"] for e in eps] == ["context_exhausted", "max_steps"]
    assert [e["sample_index"] for e in eps] == [0, 1]
