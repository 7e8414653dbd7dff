"""The step-wise environment: the trainer generates, sandflow runs the sandbox.

    env = SandboxEnv(warehouse="warehouse_data", tags=RolloutTags(training_run="r1", step=3))
    messages = env.reset(row)              # a Task, or a verl/rllm row (datasets_prep.rows)
    while True:
        text = policy.generate(messages, tools=env.tools)      # the trainer's own generation
        out = env.step(text)               # raw text or an OpenAI assistant message
        messages += [assistant(text)] + out.observations
        if out.done:
            break                          # out.reward: the verifier's score
    env.close()

The episode is the agent loop's own (tasks.loop.SteppedEpisode): the same tools, prompts,
limits (max steps, wall clock, per-command timeout, observation cap) and records; every
episode is recorded in the warehouse like any run, tagged with the training run, step and
policy version. `step` returns reward 0.0 until the episode is done, then the verifier's
score. An infrastructure failure (the sandbox broke) is never a reward: `step` raises
`InfraError` after recording the episode as such; opening a sandbox is retried first.

The warehouse run (one per training run and process, or `run_id=`) reads `running` while
the process lives and ends when it exits, or at `finish_runs()` (rl.envruns): `finished`,
or `interrupted` naming the episodes left running. Another process writing the same
run_id is refused by `reset()` (engine.RunLockedError) before it opens or writes anything.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from analysis.trajectory import Reward, reward, score_row
from datasets_prep.closing import ClosedOnExit
from datasets_prep.rows import task_from_row
from datasets_prep.task import Task
from rl.envruns import TrackedRecorder, open_env_run, taken_samples
from rl.envruns import finish_runs as finish_runs  # rl.env.finish_runs(): end the env runs
from rl.recording import RolloutRecorder, RolloutTags
from rl.toolcalls import ToolCallFormat, reply_from_action
from sandbox.base import SandboxConfig, SandboxError
from tasks.loop import Limits, SteppedEpisode
from tasks.model import ModelConfig
from tasks.prompts import load_prompts
from tasks.records import INFRA_TERMINATIONS, EpisodeRecord, NullRecorder, Recorder, Termination

ObservationRole = Literal["tool", "user"]


class InfraError(RuntimeError):
    """The sandbox broke under the episode (recorded as sandbox_error): not a reward."""

    def __init__(self, message: str, record: EpisodeRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


class _OpenFailed(Exception):
    pass


@dataclass
class StepResult:
    observations: list[dict[str, Any]]  # what the environment said: tool results, or a nudge
    reward: float  # 0.0 until done; then the verifier's score
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


_SAMPLES: dict[tuple[str, str], itertools.count[int]] = {}
_SAMPLES_LOCK = threading.Lock()


def _next_sample(run_id: str, task_id: str) -> int:
    """Sample indices per (run, task) in this process, so episode keys never collide."""
    with _SAMPLES_LOCK:
        counter = _SAMPLES.setdefault((run_id, task_id), itertools.count())
        return next(counter)


def _start_samples_after(run_id: str, taken: dict[str, int]) -> None:
    """Sample indices of `run_id` continue after those already stored (rl.envruns)."""
    with _SAMPLES_LOCK:
        for task_id, top in taken.items():
            counter = _SAMPLES.get((run_id, task_id))
            start = top + 1 if counter is None else max(top + 1, next(counter))
            _SAMPLES[(run_id, task_id)] = itertools.count(start)


_PROCESS_RUNS: dict[tuple[int, str], str] = {}


def default_run_id(tags: RolloutTags) -> str:
    """One warehouse run per training run and process: `<training_run>-env-<pid>-<random>`.

    Per process, so that trainers that make one environment object per trajectory (SkyRL)
    still write one run, and two processes never write the same episode keys (a child
    made by fork() gets its own: the parent's run is the parent's, rl.envruns).
    """
    base = "".join(c if c.isalnum() or c in "._-" else "-" for c in (tags.training_run or "rl"))
    base = base.lstrip("._-") or "rl"
    pid = os.getpid()
    with _SAMPLES_LOCK:
        if (pid, base) not in _PROCESS_RUNS:
            _PROCESS_RUNS[pid, base] = f"{base[:80]}-env-{pid}-{secrets.token_hex(3)}"
        return _PROCESS_RUNS[pid, base]


class SandboxEnv(ClosedOnExit):
    """One episode at a time in one sandbox; reuse the object for the next episode."""

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas to render for the policy: the current episode's prompt set's
        (before the first reset: the prompt folder's), the ones its episodes record."""
        if self.episode is not None:
            return self.episode.tools
        return load_prompts("general", self.prompt_dir).tools

    def __init__(
        self,
        *,
        sandbox: SandboxConfig | None = None,
        limits: Limits | None = None,
        warehouse: str | Path | None = None,
        recorder: Recorder | None = None,
        tags: RolloutTags | None = None,
        run_id: str | None = None,
        policy: ModelConfig | str = "policy",
        tool_call_format: ToolCallFormat = "auto",
        observation_role: ObservationRole = "tool",
        prompt_dir: str | None = None,
        open_attempts: int = 3,
        durability: Literal["turn", "sync", "flush"] = "turn",
    ) -> None:
        """
        Args:
            sandbox: how to open each episode's sandbox (default: docker, network none).
            limits: the episode's limits (max_steps, wall_clock_s, exec_timeout_s, ...).
            warehouse: record every episode there (one warehouse run per env, see run_id).
            recorder: or any tasks.records.Recorder (default: in memory only).
            tags: training run, step and policy version stamped on every episode; `step`
                and `policy_version` may change between episodes (`env.tags.step = n`).
            run_id: the warehouse run (default: default_run_id(tags)).
            policy: the policy's name (or a ModelConfig with its sampling) for the records.
            tool_call_format: how tool calls are read from raw text (rl.toolcalls.FORMATS).
            observation_role: "tool" (tool messages) or "user" for chat templates without
                a tool role.
            open_attempts: tries to open a sandbox before reset() raises InfraError.
        """
        self.sandbox_cfg = sandbox
        self.limits = limits or Limits()
        self.tags = tags or RolloutTags()
        self.run_id = run_id or default_run_id(self.tags)
        self.policy = policy if isinstance(policy, ModelConfig) else ModelConfig(model=policy)
        self.tool_call_format: ToolCallFormat = tool_call_format
        self.observation_role: ObservationRole = observation_role
        self.prompt_dir = prompt_dir
        self.open_attempts = max(1, open_attempts)
        self.warehouse = Path(warehouse) if warehouse is not None else None
        if recorder is None and self.warehouse is not None:
            from warehouse.writer import EpisodeWriter

            recorder = EpisodeWriter(self.warehouse, durability=durability)
        self._inner = recorder or NullRecorder()
        if self.warehouse is not None:  # the run counts the episodes it has running
            self._inner = TrackedRecorder(self._inner, self.warehouse)
        self.recorder = RolloutRecorder(self._inner, self.tags)
        self.task: Task | None = None
        self.episode: SteppedEpisode | None = None
        self.reward: Reward | None = None
        self.step_overhead_s: list[float] = []  # the env's own time per step, tools excluded

    # -- gym API --------------------------------------------------------------------
    def reset(
        self, task: Task | Mapping[str, Any] | str, *, sample_index: int | None = None
    ) -> list[dict[str, Any]]:
        """Start an episode of `task` (a Task or a dataset row); returns its first messages.

        A running episode is ended first (recorded as interrupted). Raises InfraError when
        no sandbox could be opened after `open_attempts` tries, RowError for a bad row,
        engine.RunLockedError (before anything is opened or written) when another process
        writes this env's run_id.
        """
        if self.episode is not None and not self.episode.done:
            self.close("interrupted", "reset() before the episode ended")
        self.task = task_from_row(task)
        self.reward = None
        self._write_run()
        if self.warehouse is not None:  # the run keeps the exact tasks it ran (once each)
            from warehouse.store import Warehouse

            Warehouse(self.warehouse).keep_tasks(self.run_id, [self.task], name="rl-env")
        index = (
            sample_index if sample_index is not None else _next_sample(self.run_id, self.task.id)
        )
        try:
            for attempt in Retrying(
                retry=retry_if_exception_type(_OpenFailed),
                stop=stop_after_attempt(self.open_attempts),
                wait=wait_random_exponential(multiplier=0.2, max=2.0),
                reraise=True,
            ):
                with attempt:
                    messages = self._start(index)
        except _OpenFailed as exc:
            rec = self.episode.record if self.episode else None
            raise InfraError(
                f"could not start an episode of task {self.task.id!r} after "
                f"{self.open_attempts} attempt(s): {exc}",
                rec,
            ) from None
        return messages

    def step(
        self,
        action: str | Mapping[str, Any],
        *,
        prompt_token_ids: list[int] | None = None,
        completion_token_ids: list[int] | None = None,
        logprobs: list[float] | None = None,
        usage: Mapping[str, Any] | None = None,
        finish_reason: str | None = None,
        end: bool = True,
    ) -> StepResult:
        """Run the turn's tool calls; the token ids, when given, are recorded exactly.

        `end=False`: a turn that ends the episode (submit, a limit, a broken sandbox)
        leaves it unrecorded and unscored until `end()`, so that a trainer which learns
        the turns' token ids only after its whole rollout (TRL) can attach them first."""
        t0 = time.perf_counter()
        ep = self._running()
        reply = reply_from_action(
            action,
            fmt=self.tool_call_format,
            id_prefix=f"call_{len(ep.turns)}_",
            prompt_token_ids=prompt_token_ids,
            completion_token_ids=completion_token_ids,
            logprobs=logprobs,
            usage=usage,
            finish_reason=finish_reason,
        )
        new = ep.step(reply)
        observations = [self._observation(m) for m in new]
        info: dict[str, Any] = {"episode_id": ep.record.episode_id, "turn": len(ep.turns) - 1}
        reward = 0.0
        if ep.done and end:
            reward = self._end(info)
        tools_s = ep.turns[-1].tool_latency_s if ep.turns else 0.0
        self.step_overhead_s.append(max(0.0, time.perf_counter() - t0 - tools_s))
        return StepResult(observations=observations, reward=reward, done=ep.done, info=info)

    def fork(self, k: int) -> list[SandboxEnv]:
        """k environments that continue this episode from here, for tree rollouts: each
        has the same history (`messages`, the turn count, the turns' token ids) and its
        own fork of the sandbox (files and shell state; running processes are not carried:
        `fork_info` names them). Each is a new episode of this env's run, recorded with
        lineage (parent episode, branch turn, kind "fork") and its own sample index; step
        them like this env, which goes on unchanged. Raises InfraError when the sandbox
        could not be forked (no child is left open; this episode is untouched)."""
        if not 1 <= k <= 64:
            raise ValueError(f"fork: k must be between 1 and 64, got {k}")
        ep = self._running()
        assert self.task is not None
        indices = [_next_sample(self.run_id, self.task.id) for _ in range(k)]
        try:
            episodes = ep.fork(indices)
        except SandboxError as exc:
            raise InfraError(
                f"could not fork episode {ep.record.episode_id} at turn {len(ep.turns)}: {exc}"
            ) from None
        envs = []
        for child in episodes:
            env = object.__new__(SandboxEnv)
            env.__dict__.update(self.__dict__)
            env.tags = self.tags.model_copy()
            env.episode, env.reward, env.step_overhead_s = child, None, []
            envs.append(env)
        return envs

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The episode's history so far (a copy): system, task, then every turn's messages."""
        return [dict(m) for m in self.episode.messages] if self.episode is not None else []

    @property
    def fork_info(self) -> Any:
        """What this env's sandbox knows of its making (sandbox.fork.ForkInfo), or None."""
        box = self.episode.sandbox if self.episode is not None else None
        return getattr(box, "fork_info", None)

    def close(self, reason: Termination = "interrupted", error: str | None = None) -> None:
        """End a running episode with `reason` (recorded) and release its sandbox. Idempotent."""
        if self.episode is not None and not self.episode.done:
            self.episode.finish(reason, error or "the trainer closed the environment")
        elif self.episode is not None:
            self.episode.finish()

    def end(self, info: dict[str, Any] | None = None) -> float:
        """Record and score the episode that `step(..., end=False)` (or `episode.finish`)
        ended: the verifier's score, or InfraError when infrastructure ended it."""
        return self._end(info if info is not None else {})

    # -- internals ------------------------------------------------------------------
    def _start(self, index: int) -> list[dict[str, Any]]:
        assert self.task is not None
        self.episode = SteppedEpisode(
            self.task,
            self.sandbox_cfg,
            self.recorder,
            model_cfg=self.policy,
            sample_index=index,
            run_id=self.run_id,
            limits=self.limits,
            prompt_dir=self.prompt_dir,
        )
        self.recorder.tag(self.episode.record, self.tags)
        messages = self.episode.start()
        if self.episode.done:  # the sandbox did not open, or the inputs could not be placed
            rec = self.episode.finish()
            raise _OpenFailed(rec.error or str(rec.termination))
        return messages

    def _running(self) -> SteppedEpisode:
        if self.episode is None:
            raise RuntimeError("call reset(task) before step()")
        if self.episode.done:
            raise RuntimeError(
                f"the episode has ended ({self.episode.record.termination}): call reset(task)"
            )
        return self.episode

    def _observation(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("role") == "tool" and self.observation_role == "user":
            return {"role": "user", "content": message.get("content", "")}
        return message

    def _end(self, info: dict[str, Any]) -> float:
        assert self.episode is not None and self.task is not None
        record = self.episode.finish()
        info.update(
            termination=record.termination,
            answer=record.answer,
            error=record.error,
            token_ids_status=record.token_ids_status,
        )
        if record.termination in INFRA_TERMINATIONS:
            raise InfraError(
                f"episode {record.episode_id} (task {self.task.id!r}) ended by an "
                f"infrastructure failure, not scored: {record.termination}: {record.error}",
                record,
            )
        self.reward = reward(self.task, record.answer)
        info.update(reward_reason=self.reward.reason, verifier=self.reward.verifier)
        if self.warehouse is not None:  # the reward as a score, like any scored run
            from warehouse.store import Warehouse

            wh = Warehouse(self.warehouse)
            wid = wh.write_id_of(record.run_id, record.episode_id)  # the attempt just recorded
            wh.write_scores([score_row(record, self.task, self.reward, write_id=wid)])
        return self.reward.score

    def _write_run(self) -> None:
        """The env's run: held by this process and `running` from its first episode to the
        process's end (rl.envruns); RunLockedError when another process writes it."""
        if self.warehouse is None:
            return
        opened = open_env_run(
            self.warehouse,
            self.run_id,
            model=self.policy.model,
            notes="rl step-wise environment",
            config={
                "form": "env",
                "training_run": self.tags.training_run,
                "policy": self.policy.public_dict(),
                "limits": self.limits.model_dump(),
            },
        )
        if opened:
            _start_samples_after(self.run_id, taken_samples(self.warehouse, self.run_id))
