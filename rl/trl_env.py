"""sandflow as TRL's environment: `GRPOTrainer(environment_factory=session.factory)`.

A thin adapter over the step-wise `SandboxEnv` (rl/env.py): one instance per rollout (TRL
pools and resets them), whose public methods are the sandbox's three tools, rendered into
the chat template from their signatures and docstrings:

    session = RolloutSession(warehouse="wh", sandbox=SandboxConfig(reuse="pool"),
                             tags=RolloutTags(training_run="grpo-smollm2"))
    trainer = rl.train.SandflowGRPOTrainer(model, args=GRPOConfig(...),
                                           train_dataset=session.dataset(tasks),
                                           environment_factory=session.factory)

- `reset(**row)`: the dataset row (verl's shape, `datasets_prep.rows`) becomes the task;
  a sandbox comes from the warm pool and the task's files are placed, as every episode's
  (`SandboxEnv.reset`). The row's `prompt` must be the episode's first messages (it is,
  for rows made by `session.dataset`: `analysis.rollouts.sandbox_prompt`).
- each tool call is one step of the episode (the agent loop's own tools, limits and
  records). **Arguments**: whatever the model sends goes to the tool layer as in every
  sandflow episode, which reads the arguments it knows and answers a wrong call with one
  error observation (a missing `command`, an unknown tool); an argument a tool does not
  take is ignored, never a Python TypeError. (With `SandflowGRPOTrainer` every call the
  parser found, known tool or not, reaches the episode.)
- the reward (`get_reward`) is the task's own verifier on the episode's answer (answer
  file, else submit's `answer`, else the last message). An infrastructure failure (the
  sandbox broke, no sandbox could be opened, a ground truth the verifier cannot use) is
  never a reward: `get_reward` returns None, so TRL leaves the sample out of its group's
  baseline and gives it no advantage, and `SandflowGRPOTrainer` masks all its tokens; the
  session counts it (`dropped`).
- token ids: `SandflowGRPOTrainer` hands each env the ids the trainer trains on (prompt,
  completion, TRL's tool mask) before rewards are computed; they are attached to the
  episode's turns exactly (policy segment k = the turn of assistant message k, the
  environment's tokens between them), so the warehouse's trajectory (analysis.token_ids)
  has the trainer's ids and mask. Tokens the policy generated after its `submit` (TRL
  keeps generating after every tool result) are not part of the episode: their mask is
  set to 0, so the trainer trains exactly on what the warehouse records.
- every rollout is an episode of the session's warehouse run, tagged with the training
  run, step and policy version (`rl_steps`, `training_steps`); `session.close()` (and
  the process's exit) ends every episode still open as `interrupted` and gives every
  sandbox back.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from analysis.trajectory import RewardError
from datasets_prep.task import Task
from rl.env import InfraError, SandboxEnv, default_run_id
from rl.recording import RolloutTags
from sandbox.base import SandboxConfig
from tasks.loop import Limits
from tasks.model import ModelReply
from tasks.records import INFRA_TERMINATIONS, TurnRecord, Usage

Decode = Callable[[list[int]], str]


@dataclass
class StepTimes:
    """Where the environment's time went during one training step (seconds)."""

    reset_s: float = 0.0  # sandboxes from the pool, files placed
    tools_s: float = 0.0  # tool calls in the sandboxes
    end_s: float = 0.0  # answer read, sandbox handed back, episode recorded, verifier
    rollouts: int = 0
    dropped: int = 0  # infrastructure failures: no reward, no gradient
    episode_ids: list[str] = field(default_factory=list)

    @property
    def env_s(self) -> float:
        return self.reset_s + self.tools_s + self.end_s


class RolloutSession:
    """What every rollout of one training run shares: where episodes are recorded, how
    sandboxes are opened, the episode limits, the tags (step and policy version move on as
    training does) and the environment's time per step."""

    def __init__(
        self,
        *,
        warehouse: str | Path | None,
        sandbox: SandboxConfig | None = None,
        limits: Limits | None = None,
        tags: RolloutTags | None = None,
        run_id: str | None = None,
        policy: str = "policy",
        prompt_dir: str | Path | None = None,
    ) -> None:
        self.prompt_dir = str(prompt_dir) if prompt_dir is not None else None
        self.warehouse = Path(warehouse) if warehouse is not None else None
        self.sandbox = sandbox or SandboxConfig(reuse="pool")
        self.limits = limits or Limits()
        self.tags = tags or RolloutTags()
        self.run_id = run_id or default_run_id(self.tags)
        self.policy = policy
        self.recorder: Any = None
        if self.warehouse is not None:  # one writer for every rollout of the process
            from warehouse.writer import EpisodeWriter

            self.recorder = EpisodeWriter(self.warehouse)
        self.envs: list[SandflowTRLEnv] = []
        self.times = StepTimes()
        self.dropped_total = 0
        self._lock = threading.Lock()
        self._closed = False

    # what TRL calls: environment_factory() -> one environment per rollout
    def factory(self) -> SandflowTRLEnv:
        env = SandflowTRLEnv(self)
        with self._lock:
            self.envs.append(env)
        return env

    def dataset_rows(self, tasks: Sequence[Task]) -> list[dict[str, Any]]:
        """verl rows (datasets_prep.rows) whose `prompt` is each task's first messages
        (the episode's own prompts: sandflow's, or the session's `prompt_dir`)."""
        from datasets_prep.rows import task_rows
        from tasks.loop import load_task_prompts

        return task_rows(tasks, lambda t: load_task_prompts(t, self.prompt_dir).sandbox_messages(t))

    def dataset(self, tasks: Sequence[Task]) -> Any:
        """The rows as a `datasets.Dataset` (what GRPOTrainer's train_dataset takes)."""
        from datasets import Dataset

        return Dataset.from_list(self.dataset_rows(tasks))

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas every rollout is offered: the prompt folder's tool set
        (tasks/prompts.py), the same a benchmark of the policy offers. The trainer renders
        these, not the signatures of the methods below (make_trainer)."""
        from tasks.prompts import load_prompts

        return [dict(t) for t in load_prompts("general", self.prompt_dir).tools]

    def take_times(self) -> StepTimes:
        """The environment's time since the last call (one training step's), reset."""
        with self._lock:
            times, self.times = self.times, StepTimes()
        return times

    def _add(self, what: str, seconds: float) -> None:
        with self._lock:
            setattr(self.times, what, getattr(self.times, what) + seconds)

    def _ended(self, episode_id: str | None, dropped: bool) -> None:
        with self._lock:
            self.times.rollouts += 1
            if episode_id:
                self.times.episode_ids.append(episode_id)
            if dropped:
                self.times.dropped += 1
                self.dropped_total += 1

    def close(self, reason: Literal["interrupted"] = "interrupted") -> None:
        """End every rollout still open (recorded `interrupted`, never scored) and give
        its sandbox back; then the warm pools of this process are closed. Idempotent."""
        with self._lock:
            envs, self._closed = list(self.envs), True
        for env in envs:
            env._close(reason)
        if self.recorder is not None:
            self.recorder.close()


class _AnyTool(dict[str, Any]):
    """TRL's per-rollout tool table, answering for every name: each call the parser
    found reaches the episode (an unknown tool gets the tool layer's own error)."""

    def __init__(self, env: SandflowTRLEnv) -> None:
        super().__init__()
        self._env = env

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)

    def __getitem__(self, name: str) -> Callable[..., str]:
        env = self._env

        def call(**arguments: Any) -> str:
            return env._call(name, arguments)

        call.__name__ = name
        return call


class SandflowTRLEnv:
    """One rollout in one sandbox (TRL makes one per rollout and resets it for the next).

    Public methods are TRL's tools (their docstrings are the tool descriptions); every
    other member is private on purpose: TRL exposes each public function as a tool."""

    def __init__(self, session: RolloutSession) -> None:
        self._session = session
        self._env = SandboxEnv(
            sandbox=session.sandbox,
            limits=session.limits,
            warehouse=session.warehouse,
            recorder=session.recorder,
            tags=session.tags,
            run_id=session.run_id,
            policy=session.policy,
            prompt_dir=session.prompt_dir,
        )
        self._live: list[TurnRecord] = []  # the turns the tool calls made, in order
        self._reward: float | None = None
        self._dropped: str | None = None  # why this rollout has no reward
        self._ended = True
        self._calls = 0

    # -- TRL's protocol -------------------------------------------------------------
    def reset(self, **row: Any) -> None:
        """Start the rollout's episode: the task from the dataset row, a sandbox from the
        warm pool, the task's files placed. Returns None: the row's prompt is the
        episode's first messages."""
        self._close("interrupted")  # a rollout TRL never finished (a crash mid-batch)
        self._live, self._reward, self._dropped, self._calls = [], None, None, 0
        self._ended = False
        t0 = time.perf_counter()
        try:
            messages = self._env.reset(dict(row))
        except InfraError as exc:
            self._drop(str(exc))
            return None
        finally:
            self._session._add("reset_s", time.perf_counter() - t0)
        prompt = row.get("prompt")
        if prompt is not None and _plain(prompt) != _plain(messages):
            self._env.close("interrupted", "the dataset row's prompt is not the episode's")
            self._ended = True
            raise ValueError(
                f"task {self._env.task.id if self._env.task else '?'}: the row's `prompt` differs "
                "from the episode's first messages; make the rows with RolloutSession.dataset"
            )
        return None

    def get_reward(self) -> float | None:
        """The verifier's score of the episode; None (no reward, no gradient) when
        infrastructure ended it."""
        if not self._ended:
            self._finish(None)
        return self._reward

    # -- the tools (schemas from these signatures; calls go through `_call`) --------
    def execute_bash(self, command: str) -> str:
        """Run a bash command in the sandbox's shell; returns its output and exit code.

        Args:
            command: The command, e.g. `cat /testbed/documents/notes.txt`.
        """
        return self._call("execute_bash", {"command": command})

    def str_replace_editor(
        self,
        command: str,
        path: str,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: list[int] | None = None,
    ) -> str:
        """View, create or edit a file.

        Args:
            command: view, create, str_replace, insert or undo_edit.
            path: Absolute path.
            file_text: For create.
            old_str: For str_replace: the text to replace.
            new_str: For str_replace and insert.
            insert_line: For insert: after this line.
            view_range: For view: [start, end].
        """
        args = {"command": command, "path": path, "file_text": file_text, "old_str": old_str,
                "new_str": new_str, "insert_line": insert_line, "view_range": view_range}
        return self._call("str_replace_editor", {k: v for k, v in args.items() if v is not None})

    def submit(self, answer: str | None = None) -> str:
        """Finish the task.

        Args:
            answer: The final answer (else /testbed/output/answer.txt is read).
        """
        return self._call("submit", {} if answer is None else {"answer": answer})

    # -- internals ------------------------------------------------------------------
    def _tool_dict(self) -> _AnyTool:
        return _AnyTool(self)

    def _call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One tool call as one step of the episode; returns the observation the episode
        records (the model sees exactly that)."""
        if self._dropped is not None:
            return "ERROR: the sandbox of this rollout failed (infrastructure); the call was not run."
        ep = self._env.episode
        if ep is None or self._ended or ep.done:
            return "Not executed: submit already ended the task."
        self._calls += 1
        try:
            args_json = json.dumps(dict(arguments), ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            args_json = str(arguments)
        message = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": f"call_{self._calls}", "type": "function",
                            "function": {"name": str(name)[:200], "arguments": args_json}}],
        }
        t0 = time.perf_counter()
        try:
            out = self._env.step(message, end=False)
        finally:
            self._session._add("tools_s", time.perf_counter() - t0)
        if ep.turns:
            self._live.append(ep.turns[-1])
        if ep.done and ep.record.termination in INFRA_TERMINATIONS:
            return "ERROR: the sandbox failed under this call (infrastructure); this rollout is dropped."
        return "\n".join(str(o.get("content", "")) for o in out.observations)

    def _trained_on(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        tool_mask: list[int],
        completions: Sequence[Mapping[str, Any]],
        logprobs: Sequence[float] | None,
        decode: Decode,
        truncated: bool,
    ) -> None:
        """The trainer's ids of this rollout: attached to the episode's turns, the
        episode recorded and scored. `tool_mask` (TRL's: 1 = policy token) is changed in
        place: tokens after the episode's end (after submit) and every token of a
        dropped rollout become 0."""
        if self._ended and self._dropped is None:
            return
        ep = self._env.episode
        if self._dropped is not None or ep is None:
            tool_mask[:] = [0] * len(tool_mask)
            self._finish(None)
            return
        segments = _segments(tool_mask)
        assistants = [m for m in completions if m.get("role") == "assistant"]
        policy = [(a, b) for kind, a, b in segments if kind == 1]
        note = None
        if len(policy) != len(assistants):
            note = (f"{len(policy)} policy segments for {len(assistants)} assistant messages: "
                    "token ids not attached")
            policy = []
        live = list(self._live)
        prompt = list(prompt_ids)
        ids = list(completion_ids)
        stop_at: int | None = None  # where the episode ended (masked from here on)
        for (a, b), msg in zip(policy, assistants, strict=False):
            calls = msg.get("tool_calls") or []
            mine, live = live[: len(calls)], live[len(calls) :]
            seg = ids[a:b]
            text = decode(seg)
            if not mine:  # a turn that ran nothing: no call, or calls TRL did not run
                if ep.done:
                    stop_at = a
                    break
                # the turn's text as said, with no call run (whatever it holds: TRL ran none)
                ep.step(ModelReply(content=text, tool_calls=[], reasoning_content=None,
                                   finish_reason="stop", usage=Usage(), latency_s=0.0))
                turn = ep.turns[-1]
                _drop_nudge(ep, turn)
                mine = [turn]
            first = mine[0]
            _attach(first, prompt + ids[:a], seg, _slice(logprobs, a, b), text)
            for later in mine[1:]:
                _attach(later, prompt + ids[:b], [], [] if logprobs is not None else None, None)
            if ep.done and mine[-1] is ep.turns[-1]:
                stop_at = b  # submitted (or a limit) at this message: the rest is not the episode's
                break
        if note is not None:
            for t in ep.turns:
                t.prompt_token_ids = t.completion_token_ids = t.completion_logprobs = None
        if stop_at is not None:
            for i in range(stop_at, len(tool_mask)):
                tool_mask[i] = 0
        # the last message's calls ran, yet no tool tokens follow it: TRL dropped their
        # results because with them the rollout would pass max_completion_length
        results_dropped = bool(policy) and segments[-1][0] == 1 and bool(assistants[-1].get("tool_calls")) \
            and any(t is ep.turns[-1] for t in self._live)
        if not ep.done:
            if truncated or results_dropped:
                ep.finish("context_exhausted", "the trainer's completion budget (max_completion_length) ran out"
                          + (": TRL dropped the last tool results" if results_dropped else ""))
            else:
                ep.finish("max_steps", "the rollout ended: TRL stops at a turn without a tool call"
                          " (or at max_tool_calling_iterations)")
        if note is not None:
            ep.record.error = " ".join(x for x in (ep.record.error, note) if x)
        self._finish(tool_mask)

    def _finish(self, tool_mask: list[int] | None) -> None:
        """Record and score the episode (once)."""
        if self._ended:
            return
        self._ended = True
        ep = self._env.episode
        t0 = time.perf_counter()
        try:
            if self._dropped is None and ep is not None:
                if not ep.done:
                    ep.finish("max_steps", "the rollout ended without the trainer's token ids")
                try:
                    self._reward = self._env.end()
                except InfraError as exc:
                    self._dropped = str(exc)
                except RewardError as exc:
                    self._dropped = str(exc)
            if self._dropped is not None:
                self._reward = None
                if tool_mask is not None:
                    tool_mask[:] = [0] * len(tool_mask)
        finally:
            self._session._add("end_s", time.perf_counter() - t0)
            rid = ep.record.episode_id if ep is not None else None
            self._session._ended(rid, self._dropped is not None)

    def _drop(self, why: str) -> None:
        self._dropped = why

    def _close(self, reason: Literal["interrupted"]) -> None:
        if not self._ended:
            self._ended = True
            self._env.close(reason, "training stopped before the rollout ended")
        elif self._env.episode is not None:
            self._env.episode.finish()  # idempotent: the sandbox is released


def _plain(messages: Any) -> list[tuple[str, str]]:
    return [(str(m.get("role")), str(m.get("content") or "")) for m in messages or []]


def _segments(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of equal mask values: (value, start, end)."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


def _slice(values: Sequence[float] | None, a: int, b: int) -> list[float] | None:
    return None if values is None else [float(v) for v in values[a:b]]


def _attach(turn: TurnRecord, prompt: list[int], completion: list[int],
            logprobs: list[float] | None, text: str | None) -> None:
    turn.prompt_token_ids = prompt
    turn.completion_token_ids = completion
    turn.completion_logprobs = logprobs
    turn.usage.prompt_tokens = len(prompt)
    turn.usage.completion_tokens = len(completion)
    if text is not None:
        turn.assistant_content = text


def _drop_nudge(ep: Any, turn: TurnRecord) -> None:
    """A turn without a tool call ends TRL's rollout: the loop's nudge was never sent."""
    for nudge in turn.extra_messages:
        if ep.messages and ep.messages[-1] == nudge:
            ep.messages.pop()
    turn.extra_messages = []
