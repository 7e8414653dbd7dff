"""SkyRL adapter: sandflow's sandbox as a `skyrl_gym` text environment.

    import rl.skyrl
    rl.skyrl.register()                      # env_class "sandflow"

SkyRL's generator makes one environment per trajectory with
``skyrl_gym.make("sandflow", env_config=cfg.environment.skyrl_gym.sandflow, extras=row)``,
calls ``init(prompt)``, then ``step(generated_text)`` until ``done``, then ``close()``.
Here:

- ``extras`` is the dataset row: the task comes from its ``extra_info`` (the
  LLM-in-Sandbox-RL row contract, datasets_prep.rows); the row's ``prompt`` is replaced by
  sandflow's own first messages (system + task), which `init` returns.
- ``step`` reads the tool calls from the generated text (Hermes/Qwen ``<tool_call>`` by
  default), runs them, and returns the tool messages; reward 0.0 until done, then the
  verifier's score. ``extras["max_turns"]`` (SkyRL's generator.max_turns) caps max_steps.
- ``close()`` on an episode that is not done (SkyRL stopped at its max_input_length)
  records it as ``context_exhausted``.
- env_config keys (all optional): warehouse, run_id, training_run, training_step,
  policy_version, policy, tool_call_format, observation_role, limits {...},
  sandbox {...} (a SandboxConfig), prompt_dir. ``extras["training_step"]`` overrides the
  step per row.

An infrastructure failure raises rl.env.InfraError (recorded in the warehouse as such):
it is never handed to the trainer as a zero reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from rl.env import SandboxEnv
from rl.recording import RolloutTags
from sandbox.base import SandboxConfig
from tasks.loop import Limits

ENV_ID = "sandflow"


def _plain(cfg: Any) -> dict[str, Any]:
    """env_config as a dict (SkyRL hands an OmegaConf DictConfig)."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - omegaconf comes with skyrl-gym
        pass
    if isinstance(cfg, Mapping):
        return dict(cfg)
    return {k: getattr(cfg, k) for k in dir(cfg) if not k.startswith("_")}


class SandflowSkyRLEnv(BaseTextEnv):
    """One trajectory of one task in one sandbox (see the module docstring)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        cfg = _plain(env_config)
        self.extras = dict(extras or {})
        limits = Limits(**(cfg.get("limits") or {}))
        if self.extras.get("max_turns"):
            limits.max_steps = min(limits.max_steps, int(self.extras["max_turns"]))
        self.max_turns = limits.max_steps
        step = self.extras.get("training_step", cfg.get("training_step"))
        tags = RolloutTags(
            training_run=cfg.get("training_run"),
            step=int(step) if step is not None else None,
            policy_version=cfg.get("policy_version"),
        )
        sandbox = SandboxConfig(**cfg["sandbox"]) if cfg.get("sandbox") else None
        self.env = SandboxEnv(
            sandbox=sandbox,
            limits=limits,
            warehouse=cfg.get("warehouse"),
            tags=tags,
            run_id=cfg.get("run_id"),
            policy=str(cfg.get("policy") or "policy"),
            tool_call_format=cfg.get("tool_call_format", "auto"),
            observation_role=cfg.get("observation_role", "tool"),
            prompt_dir=cfg.get("prompt_dir"),
        )
        self.reward = 0.0
        self.done = False

    def init(self, prompt: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        messages = self.env.reset(self.extras)
        assert self.env.episode is not None
        return messages, {"episode_id": self.env.episode.record.episode_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        out = self.env.step(action)
        self.reward, self.done = out.reward, out.done
        return BaseTextEnvStepOutput(
            observations=out.observations, reward=out.reward, done=out.done, metadata=out.info
        )

    def close(self) -> None:
        if not self.done:
            self.env.close("context_exhausted", "the trainer stopped generating (its input length)")
        else:
            self.env.close()

    def get_metrics(self) -> dict[str, Any]:
        rec = self.env.episode.record if self.env.episode else None
        return {
            "turns": self.turns,
            "reward": self.reward,
            "submitted": float(rec is not None and rec.termination == "submitted"),
        }


def register(env_id: str = ENV_ID) -> str:
    """Register the environment with skyrl_gym (idempotent); returns its id."""
    import skyrl_gym

    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point="rl.skyrl:SandflowSkyRLEnv")
    return env_id
