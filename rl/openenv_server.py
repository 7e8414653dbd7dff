"""sandflow's sandbox served as an OpenEnv environment (openenv-core 0.3).

    sandflow rl openenv --tasks tasks.parquet --warehouse wh      # 127.0.0.1:8771

Each OpenEnv session (one WebSocket connection of `openenv.GenericEnvClient` or any
`EnvClient`) owns one `rl.env.SandboxEnv`; the server is openenv-core's own app
(`openenv.core.env_server.create_app`: /ws, /reset, /step, /state, /schema, /health).

- `reset(task_id=ID)` (a task of the server's task set) or `reset(task={...})` (a task or
  dataset row, datasets_prep.rows) opens a sandbox with the task's files; the observation's
  `messages` are sandflow's first messages (system + task), `tools` the three tool schemas.
- `step({"tool": NAME, "arguments": {...}})` runs one tool call (or `{"message": TEXT}`:
  a raw generated turn, its tool calls read as rl.toolcalls reads them); the observation's
  `messages` are the tool results; `reward` is None until `done`, then the task's
  verifier's score (`termination`, `answer`, `reward_reason` beside it).
- All sessions write one warehouse run (`run_id`), like any sandflow run.
- A client that disconnects ends its session: openenv-core closes the environment, which
  records the episode as `interrupted` and removes its sandbox.

Bad input is refused through OpenEnv's error path (the client raises `RuntimeError:
Server error: <one sentence>`): a task set whose tasks cannot be scored, an unknown task
id, an unknown tool, arguments that are not a JSON object, a step before reset.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openenv.core.env_server import create_app as openenv_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from datasets_prep.task import Task
from sandbox.base import SandboxConfig
from tasks.loop import Limits
from tasks.tools import TOOL_SCHEMAS

TOOL_NAMES = tuple(s["function"]["name"] for s in TOOL_SCHEMAS)
MAX_ACTION_CHARS = 1_000_000


class SandflowAction(Action):
    """One tool call (`tool` + `arguments`), or a raw generated turn (`message`)."""

    tool: str | None = Field(default=None, description="execute_bash, str_replace_editor or submit")
    arguments: dict[str, Any] | str = Field(default_factory=dict, description="the call's arguments")
    message: str | None = Field(default=None, description="or: the raw assistant turn")


class SandflowObservation(Observation):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    episode_id: str | None = None
    termination: str | None = None
    answer: str | None = None
    reward_reason: str | None = None
    verifier: str | None = None


@dataclass
class ServerConfig:
    """What every session's environment shares (handed in by the command)."""

    tasks: dict[str, Task] = field(default_factory=dict)
    warehouse: Path | None = None
    run_id: str | None = None
    training_run: str | None = None
    sandbox: SandboxConfig | None = None
    limits: Limits = field(default_factory=Limits)
    max_sessions: int = 16


class SandflowEnvironment(Environment[SandflowAction, SandflowObservation, State]):
    """One session: one SandboxEnv, one episode at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    config: ServerConfig = ServerConfig()
    _lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        from rl.env import SandboxEnv
        from rl.recording import RolloutTags

        cfg = self.config
        self.env = SandboxEnv(
            sandbox=cfg.sandbox,
            limits=cfg.limits,
            warehouse=cfg.warehouse,
            tags=RolloutTags(training_run=cfg.training_run),
            run_id=cfg.run_id,
        )
        self._state = State()

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        task_id: str | None = None,
        task: dict[str, Any] | None = None,
        sample_index: int | None = None,
        **kwargs: Any,
    ) -> SandflowObservation:
        from analysis.trajectory import check_scorable
        from datasets_prep.rows import task_from_row

        if task is not None:
            chosen = task_from_row(task)
        elif task_id is not None:
            if task_id not in self.config.tasks:
                known = ", ".join(sorted(self.config.tasks)[:5])
                raise ValueError(f"reset: no task {task_id!r} in the server's task set (e.g. {known})")
            chosen = self.config.tasks[task_id]
        else:
            raise ValueError("reset needs task_id=ID (a task of the server's task set) or task={...}")
        check_scorable(chosen)
        messages = self.env.reset(chosen, sample_index=sample_index)
        assert self.env.episode is not None
        self._state = State(episode_id=self.env.episode.record.episode_id, step_count=0)
        return SandflowObservation(
            messages=messages, tools=list(self.env.tools), episode_id=self._state.episode_id
        )

    def step(self, action: SandflowAction, timeout_s: float | None = None, **kwargs: Any) -> SandflowObservation:
        if self.env.episode is None:
            raise ValueError("step before reset: call reset(task_id=...) first")
        if self.env.episode.done:
            raise ValueError(f"the episode has ended ({self.env.episode.record.termination}): call reset")
        turn = self._turn(action)
        out = self.env.step(turn)
        self._state.step_count += 1
        obs = SandflowObservation(messages=out.observations, episode_id=self._state.episode_id, done=out.done)
        if out.done:
            info = out.info
            obs.reward = out.reward
            obs.termination, obs.answer = info.get("termination"), info.get("answer")
            obs.reward_reason, obs.verifier = info.get("reward_reason"), info.get("verifier")
        return obs

    def _turn(self, action: SandflowAction) -> str | dict[str, Any]:
        if action.message is not None:
            if len(action.message) > MAX_ACTION_CHARS:
                raise ValueError(f"action.message is {len(action.message)} characters (limit {MAX_ACTION_CHARS})")
            return action.message
        if action.tool not in TOOL_NAMES:
            raise ValueError(
                f"unknown tool {action.tool!r}: the tools are {', '.join(TOOL_NAMES)} "
                "(or send the raw turn as `message`)"
            )
        args = action.arguments
        if isinstance(args, str):
            if len(args) > MAX_ACTION_CHARS:
                raise ValueError(f"action.arguments is {len(args)} characters (limit {MAX_ACTION_CHARS})")
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as exc:
                raise ValueError(f"action.arguments is not valid JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ValueError(f"action.arguments must be a JSON object, got {type(args).__name__}")
        call = {"id": f"call_{self._state.step_count}", "type": "function",
                "function": {"name": action.tool, "arguments": json.dumps(args)}}  # fmt: skip
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        """The session ended (the client closed or went away): end the episode, remove
        its sandbox."""
        self.env.close("interrupted", "the OpenEnv client disconnected")


def create_app(cfg: ServerConfig) -> Any:
    """openenv-core's FastAPI app over sandflow's environment."""
    from analysis.trajectory import check_scorable

    for task in cfg.tasks.values():
        check_scorable(task)  # a task set that cannot reward is refused before serving
    env_cls = type("SandflowEnvironment", (SandflowEnvironment,), {"config": cfg})
    return openenv_app(
        env_cls, SandflowAction, SandflowObservation, env_name="sandflow",
        max_concurrent_envs=cfg.max_sessions,
    )  # fmt: skip


def serve(cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8771) -> None:
    import uvicorn

    uvicorn.run(create_app(cfg), host=host, port=port, log_level="warning")
