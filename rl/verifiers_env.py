"""sandflow as a `verifiers` environment (verifiers 0.4, its `verifiers.v1` stack).

    import rl.verifiers_env
    env = rl.verifiers_env.load_environment("math", warehouse="warehouse_data")  # a vf.Env

or from the command line (the taskset id is this module's name)::

    vf-eval rl.verifiers_env --env.taskset.source tasks.parquet --env.taskset.warehouse wh \\
        --env.agent.runtime.type subprocess -m Qwen/Qwen3-8B --client.base-url http://127.0.0.1:8000/v1

What maps to what (docs/interop.md, "verifiers"):

- **Tasks**: any sandflow task set (`datasets_prep.prepare.load_taskset`: a built-in suite,
  a `data build` output, a task-set file, a table) becomes a `vf.Taskset`; each task's
  prompt is sandflow's own first messages (system + task text), so the model reads what
  it reads in a sandflow run.
- **Tools**: the three tools (execute_bash, str_replace_editor, submit) are one MCP tool
  server (`SandflowTools`, taskset-scoped: one process for all rollouts). A rollout's
  first tool call opens its sandflow episode (`rl.env.SandboxEnv`: a sandbox with the
  task's files); every tool call is one step of it, recorded in the warehouse like any
  run (one warehouse run for the whole evaluation, `run_id`).
- **Rubric**: the task's own sandflow verifier (`analysis.trajectory.reward`), computed when the episode
  ends (submit, or sandflow's max_steps / wall clock) and handed back through the rollout
  state; `sandflow_reward` is the rubric's one reward function, `submitted` a metric.

Bad input is refused before any rollout through verifiers' own paths: a task set whose
tasks cannot be scored (no ground truth for the verifier) fails `Taskset.load` with one
sentence naming the task; an unknown tool or malformed arguments are answered by the
harness's MCP client (the tool server advertises exactly the three tools and validates
their arguments).

The tool server is this module run as a program (`python -m rl.verifiers_env`), which
verifiers starts itself.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import threading
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from pydantic import Field

__all__ = ["SandflowTaskset", "load_environment"]

TASKSET_ID = "sandflow-env"  # the package sandflow_env re-exports this module


class SandflowData(vf.TaskData):
    """One sandflow task: the verifiers prompt plus the task itself (sandflow's JSON)."""

    task_json: str = ""


class SandflowState(vf.State):
    """What the host and the tool server share per rollout."""

    rollout: str | None = None
    task_json: str | None = None
    episode_id: str | None = None
    run_id: str | None = None
    termination: str | None = None
    answer: str | None = None
    reward: float | None = None
    reward_reason: str | None = None
    verifier: str | None = None
    error: str | None = None


class SandflowToolsConfig(vf.SharedToolsetConfig):
    """How the tool server opens episodes (handed to its process as JSON)."""

    warehouse: str | None = None
    run_id: str = ""
    training_run: str | None = None
    policy: str = "policy"
    limits: dict[str, Any] = Field(default_factory=dict)  # tasks.loop.Limits fields
    sandbox: dict[str, Any] = Field(default_factory=dict)  # sandbox.base.SandboxConfig fields


class SandflowTools(vf.Toolset[SandflowToolsConfig, SandflowState]):
    """The three tools over one sandflow episode per rollout (a `SandboxEnv` each)."""

    TOOL_PREFIX = None  # the tools keep sandflow's names: execute_bash, str_replace_editor, submit

    def __init__(self, config: SandflowToolsConfig) -> None:
        super().__init__(config)
        self._envs: dict[str, Any] = {}
        self._lock = threading.Lock()

    async def setup(self) -> None:
        """At the server's end (verifiers sends SIGTERM when the evaluation ends, then
        SIGKILL 5 s later), close the episodes still open: rollouts that ended without
        `submit` (the model stopped calling tools, verifiers' own limits). Each is recorded
        `interrupted` with its turns, its sandbox removed, the run ended. uvicorn re-raises
        the SIGTERM it caught once it has stopped serving: this handler gets it then."""
        signal.signal(signal.SIGTERM, self._terminated)

    def _terminated(self, signum: int, frame: Any) -> None:
        self._close_all()
        raise SystemExit(0)  # atexit ends the warehouse run (rl.envruns)

    def _close_all(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with self._lock:
            envs, self._envs = list(self._envs.values()), {}
        if envs:
            with ThreadPoolExecutor(max_workers=min(16, len(envs))) as pool:
                list(pool.map(lambda e: e.close("interrupted", "the verifiers rollout ended without submit"), envs))

    @vf.tool
    async def execute_bash(self, command: str) -> str:
        """Run a bash command in the sandbox's persistent shell (working directory and
        exported variables persist between calls). Returns stdout, stderr and the exit code;
        long output is clipped in the middle."""
        return await self._call("execute_bash", {"command": command})

    @vf.tool
    async def str_replace_editor(
        self,
        command: str,
        path: str,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: list[int] | None = None,
    ) -> str:
        """View, create and edit files in the sandbox: `view` (a file with line numbers, or a
        directory), `create` (writes `file_text` to a new file), `str_replace` (replaces
        `old_str`, which must match exactly one place, with `new_str`), `insert` (`new_str`
        after line `insert_line`), `undo_edit` (reverts the last edit of `path`)."""
        args: dict[str, Any] = {"command": command, "path": path}
        extra = {
            "file_text": file_text,
            "old_str": old_str,
            "new_str": new_str,
            "insert_line": insert_line,
            "view_range": view_range,
        }
        args.update({k: v for k, v in extra.items() if v is not None})
        return await self._call("str_replace_editor", args)

    @vf.tool
    async def submit(self) -> str:
        """Finish the task: the answer is what /testbed/output/answer.txt holds."""
        return await self._call("submit", {})

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        state = self.state
        if not state.rollout or not state.task_json:
            raise RuntimeError("no sandflow task in this rollout's state (Task.setup did not run)")
        return await asyncio.to_thread(self._step, state, name, arguments)

    def _env(self, state: SandflowState) -> Any:
        from rl.env import SandboxEnv
        from rl.recording import RolloutTags
        from sandbox.base import SandboxConfig
        from tasks.loop import Limits

        assert state.rollout is not None
        with self._lock:
            env = self._envs.get(state.rollout)
            if env is not None:
                return env
            cfg = self.config
            env = SandboxEnv(
                sandbox=SandboxConfig(**cfg.sandbox) if cfg.sandbox else None,
                limits=Limits(**cfg.limits),
                warehouse=cfg.warehouse,
                tags=RolloutTags(training_run=cfg.training_run),
                run_id=cfg.run_id or None,
                policy=cfg.policy,
            )
            self._envs[state.rollout] = env
        env.reset(json.loads(state.task_json or "{}"))
        assert env.episode is not None
        state.episode_id, state.run_id = env.episode.record.episode_id, env.run_id
        return env

    def _step(self, state: SandflowState, name: str, arguments: dict[str, Any]) -> str:
        from rl.env import InfraError

        env = self._env(state)
        if env.episode is None or env.episode.done:
            return f"the episode has ended ({state.termination}); no tool runs any more"
        call = {"id": f"call_{secrets.token_hex(4)}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip
        try:
            out = env.step({"role": "assistant", "content": None, "tool_calls": [call]})
        except InfraError as exc:  # the sandbox broke: never a reward
            state.termination, state.error = "sandbox_error", str(exc)
            self._drop(state)
            raise
        if out.done:
            state.termination = out.info.get("termination")
            state.answer = out.info.get("answer")
            state.reward = out.reward
            state.reward_reason = out.info.get("reward_reason")
            state.verifier = out.info.get("verifier")
            self._drop(state)
        texts = [str(m.get("content") or "") for m in out.observations]
        return "\n".join(texts)

    def _drop(self, state: SandflowState) -> None:
        with self._lock:
            env = self._envs.pop(state.rollout or "", None)
        if env is not None:
            env.close()


class SandflowTaskConfig(vf.TaskConfig):
    pass


class SandflowTask(vf.Task[SandflowData, SandflowState, SandflowTaskConfig]):
    """One sandflow task: its prompt, its rollout state, its verifier as the reward."""

    @property
    def key(self) -> str:
        return self.data.id or self.hash

    async def setup(self, trace: vf.Trace, runtime: Any) -> None:
        trace.state.rollout = trace.id
        trace.state.task_json = self.data.task_json

    @vf.reward(weight=1.0)
    async def sandflow_reward(self, trace: vf.Trace) -> float:
        """The task's sandflow verifier on the episode's answer (0 when it never ended)."""
        return float(trace.state.reward or 0.0)

    @vf.metric
    async def submitted(self, trace: vf.Trace) -> float:
        return float(trace.state.termination == "submitted")


class SandflowTasksetConfig(vf.TasksetConfig):
    """`--env.taskset.*`: the sandflow task set and where its rollouts are recorded."""

    source: str = "math"
    """A built-in suite, `hf:NAME`, a task-set file or a table (datasets_prep.load_taskset)."""
    seed: int = 0
    size: int | None = None
    warehouse: str | None = None
    """Record every rollout there (default: not recorded)."""
    run_id: str = ""
    """The warehouse run of this evaluation (default: `vf-<random>`)."""
    training_run: str | None = None
    policy: str = "policy"
    limits: dict[str, Any] = Field(default_factory=dict)
    sandbox: dict[str, Any] = Field(default_factory=lambda: {"limits": {"network": "none"}})
    task: SandflowTaskConfig = SandflowTaskConfig()

    def model_post_init(self, context: Any) -> None:
        if not self.run_id:  # fixed here, so the tool server's process writes the same run
            self.run_id = f"vf-{secrets.token_hex(4)}"


class SandflowTaskset(vf.Taskset[SandflowTask, SandflowTasksetConfig]):
    def load(self) -> Iterator[SandflowTask]:
        from analysis.rollouts import sandbox_prompt
        from analysis.trajectory import check_scorable
        from datasets_prep.prepare import load_taskset
        from datasets_prep.rows import task_rows

        cfg = self.config
        ts = load_taskset(cfg.source, seed=cfg.seed, size=cfg.size)
        for task in ts.tasks:
            check_scorable(task)  # RewardError naming the task: before any rollout
        for task, row in zip(ts.tasks, task_rows(ts.tasks, sandbox_prompt), strict=True):
            prompt = row["prompt"]
            system = next((m["content"] for m in prompt if m["role"] == "system"), None)
            user = [{"role": m["role"], "content": m["content"]} for m in prompt if m["role"] != "system"]
            yield SandflowTask(
                SandflowData(
                    id=task.id,
                    name=task.id,
                    prompt=user,
                    system_prompt=system,
                    task_json=json.dumps(task.canonical()),
                ),
                cfg.task,
            )

    @classmethod
    def toolsets(cls, config: SandflowTasksetConfig) -> list[vf.Toolset]:
        tools = SandflowToolsConfig(
            warehouse=config.warehouse,
            run_id=config.run_id,
            training_run=config.training_run,
            policy=config.policy,
            limits=config.limits,
            sandbox=config.sandbox,
        )
        return [SandflowTools(tools)]


def load_environment(source: str = "math", **taskset: Any) -> vf.Env:
    """A verifiers environment over the sandflow task set `source` (SandflowTasksetConfig's
    fields as keywords: seed, size, warehouse, run_id, limits, sandbox, ...); its agent runs
    on the host (subprocess runtime) with verifiers' tool-calling chat loop (`null` harness)."""
    cfg = vf.SingleAgentEnvConfig.model_validate(
        {
            "taskset": {"id": TASKSET_ID, "source": source, **taskset},
            "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
        }
    )
    return vf.load_environment(cfg)


if __name__ == "__main__":  # verifiers starts the tool server as `python -m rl.verifiers_env`
    SandflowTools.run()
