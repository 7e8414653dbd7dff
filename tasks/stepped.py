"""An episode whose assistant turns come from outside: an RL trainer's policy.

The same episode as run_episode's (tasks/loop.py): the same loop (tasks/react.py, with
the model's call replaced by the trainer's reply), tools, limits and records. A live
episode can also be forked into several that continue it (rl/tree.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from datasets_prep.task import Task
from sandbox.base import Sandbox, SandboxConfig, SandboxError
from tasks.budgets import Limits
from tasks.episode import (
    CancelCheck,
    End,
    Episode,
    EpisodePrefix,
    now,
    prepare,
    take_prefix,
)
from tasks.model import ModelClient, ModelConfig, ModelReply
from tasks.opening import enter, open_sandbox, open_sandboxes, sandbox_config
from tasks.react import PolicyTurn, react
from tasks.records import (
    EpisodeRecord,
    NullRecorder,
    Recorder,
    Termination,
    TurnRecord,
    episode_key,
)
from tasks.tools import ToolBox


class SteppedEpisode:
    """An episode whose assistant turns come from outside: an RL trainer's policy.

    The trainer owns generation; this owns the sandbox, the tools, the limits and the
    records, through the same loop as run_episode (tasks/react.py, its turns sent in)::

        ep = SteppedEpisode(task, sandbox_cfg, recorder, run_id=..., sample_index=...)
        messages = ep.start()              # system + task; the sandbox is open, inputs placed
        while not ep.done:
            new = ep.step(reply)           # a ModelReply made from the policy's turn
        record = ep.finish()               # answer read, sandbox closed, episode recorded

    `step` never raises for the model's doing or for a broken sandbox: `done` turns true
    and `record.termination` says why (`sandbox_error` for the latter: infrastructure).
    The limits are the episode's: max_steps, the wall clock (which includes the policy's
    generation time between steps), the context budget when the reply carries usage,
    per-command timeouts and observation caps.
    """

    def __init__(
        self,
        task: Task,
        sandbox_cfg: SandboxConfig | None = None,
        recorder: Recorder | None = None,
        *,
        model_cfg: ModelConfig | None = None,
        sample_index: int = 0,
        run_id: str = "adhoc",
        limits: Limits | None = None,
        sandbox: Sandbox | None = None,
        output_dir: Path | str | None = None,
        prompt_dir: str | None = None,
        client: ModelClient | None = None,
    ) -> None:
        """`model_cfg` describes the policy for the records (its name and sampling); it is
        called only by `generate()` (through `client` when given). Other arguments as in
        run_episode (mode is always "sandbox")."""
        self.limits = limits or Limits()
        self.recorder = recorder or NullRecorder()
        model_cfg = model_cfg or ModelConfig(model="policy")
        prompts, messages, record = prepare(
            task, model_cfg, sandbox_cfg, self.limits, "sandbox", sample_index, run_id, prompt_dir,
            sandbox,
        )
        self._ep = Episode(
            task, model_cfg, prompts, self.limits, record, self.recorder, messages, None, client
        )
        self._prompt_dir = prompt_dir
        self._sandbox_cfg = sandbox_cfg
        self._sandbox = sandbox
        self._owned: Sandbox | None = None
        self._loop: Generator[int, PolicyTurn, None] | None = None  # react, at the policy's turn
        self._output_dir = output_dir
        self._started = self._finished = False
        self._mark = (time.monotonic(), now())  # when the policy got its last observation

    @property
    def record(self) -> EpisodeRecord:
        return self._ep.record

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The full, append-only history (the live list: do not modify it)."""
        return self._ep.messages

    @property
    def turns(self) -> list[TurnRecord]:
        return self._ep.turns

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas this episode offers (its prompt set's tool set)."""
        return self._ep.prompts.tools

    @property
    def done(self) -> bool:
        return self._ep.record.termination is not None

    @property
    def sandbox(self) -> Sandbox | None:
        return self._sandbox

    def start(self) -> list[dict[str, Any]]:
        """Open the sandbox and place the task's inputs; returns the first messages.

        A sandbox that cannot be opened ends the episode at once (`done`, sandbox_error).
        """
        if self._started:
            raise RuntimeError("SteppedEpisode.start() was already called")
        self._started = True
        self.recorder.start_episode(self.record)
        try:
            if self._sandbox is None:
                cfg = sandbox_config(self._sandbox_cfg, self.record, self._ep.task)
                self._owned = self._sandbox = open_sandbox(cfg)
            self._wait_for_policy(enter(self._ep, self._sandbox))  # the wall clock starts here
        except End as end:
            self._ep.end(end, self._sandbox)
        except BaseException:
            self._abort()
            raise
        self._mark = (time.monotonic(), now())
        return [dict(m) for m in self.messages]

    def step(self, reply: ModelReply) -> list[dict[str, Any]]:
        """Act on the policy's turn; returns the messages the environment appended after
        the assistant's: the tool results in call order, or the nudge to use a tool."""
        if not self._started or self._finished:
            raise RuntimeError("SteppedEpisode.step() needs start() first and no finish() yet")
        if self.done:
            raise RuntimeError(
                f"the episode has ended ({self.record.termination}); call finish(), not step()"
            )
        assert self._loop is not None
        ep = self._ep
        before = len(ep.messages)
        since, started = self._mark
        if not reply.latency_s:  # the policy's generation, as the loop times a model call
            reply.latency_s = time.monotonic() - since
        try:
            self._loop.send((started, reply))  # the turn; back at the next one's yield
        except End as end:
            ep.end(end, self._sandbox)
        except KeyboardInterrupt:
            self.record.termination = "interrupted"
            self.record.error = "interrupted by the user (Ctrl+C)"
            self.finish()
            raise
        except BaseException:
            self._abort()
            raise
        self._mark = (time.monotonic(), now())
        return [dict(m) for m in ep.messages[before + 1 :]]

    def finish(self, reason: Termination = "interrupted", error: str | None = None) -> EpisodeRecord:
        """End the episode: read the answer, close the sandbox, record it. Idempotent.

        An episode still running ends with `reason` (e.g. "context_exhausted" when the
        trainer's context is full, "max_steps" at the trainer's own turn limit).
        """
        if self._finished:
            return self.record
        self._finished = True
        if not self.done:
            self._ep.end(End(reason, error or "the trainer ended the episode"), self._sandbox)
        if self._sandbox is not None and self._started:
            self._ep.collect(self._sandbox, self._output_dir)
        self._ep.finish(self._owned)
        return self.record

    @property
    def cancel(self) -> CancelCheck | None:
        """The run's cancel token (as run_episode's `cancel`), checked by `generate()`."""
        return self._ep.cancel

    @cancel.setter
    def cancel(self, token: CancelCheck | None) -> None:
        self._ep.cancel = token

    def shift_clock(self, seconds: float) -> None:
        """Time the episode waited without running (a tree's branch waiting its turn) is
        not its own: its wall clock deadline moves on by `seconds`."""
        if self._ep.deadline is not None and seconds > 0:
            self._ep.deadline += seconds

    def generate(self) -> ModelReply | None:
        """The next turn from the episode's own model (`model_cfg`'s endpoint, or the
        `client`), within the limits as run_episode asks it; None when asking ended the
        episode (a model error, the context full, the wall clock, cancelled): `done` and
        `record.termination` say why. Pass the reply to `step`."""
        if not self._started or self._finished or self.done:
            raise RuntimeError("SteppedEpisode.generate() needs a started, running episode")
        try:
            self._ep.on_event("request", len(self.turns))
            return self._ep.ask(self.tools)
        except End as end:
            self._ep.end(end, self._sandbox)
            return None

    def open_branches(self, sample_indices: list[int]) -> list[Sandbox]:
        """The sandboxes a later `fork(sample_indices, boxes=...)` writes into, opened now
        (e.g. in another thread while this episode runs on: the branch point then costs
        the copy only), each labelled with its branch's episode. SandboxError on failure."""
        base = sandbox_config(self._sandbox_cfg, self.record, self._ep.task)
        run, task = self.record.run_id, self._ep.task.id
        return open_sandboxes(
            [
                base.model_copy(update={"episode_id": episode_key(run, task, "sandbox", i)})
                for i in sample_indices
            ]
        )

    def fork(
        self, sample_indices: list[int], boxes: list[Sandbox] | None = None
    ) -> list[SteppedEpisode]:
        """One episode per sample index that continues this one from here: the same
        history (messages, turns with their token ids, context budget, wall clock left),
        each in its own fork of this sandbox (sandbox.fork: files and shell state; running
        processes are not carried, `record.config["fork"]` says which were running). Each is
        recorded as a new episode whose first `branch_turn` turns are this one's, with
        lineage kind "fork"; this episode goes on unchanged. `boxes`: from open_branches
        (else opened now). Raises SandboxError (the sandbox cannot fork, or the fork
        failed: no child is left open, given boxes included)."""
        if not self._started or self._finished or self.done or self._sandbox is None:
            raise RuntimeError("SteppedEpisode.fork() needs a started, running episode")
        if not self._sandbox.capabilities.fork:
            raise SandboxError(f"a {self._sandbox.backend} sandbox cannot be forked")
        fork = self._sandbox.fork
        children = [
            SteppedEpisode(
                self._ep.task,
                self._sandbox_cfg,
                self.recorder,
                model_cfg=self._ep.model_cfg,
                sample_index=index,
                run_id=self.record.run_id,
                limits=self.limits,
                prompt_dir=self._prompt_dir,
                client=None if self._ep._own_client else self._ep._client,  # ours closes with us
            )
            for index in sample_indices
        ]
        # each child's sandbox is its own episode's (labels; a warm pool's when reuse=pool)
        if boxes is None:
            boxes = self.open_branches(sample_indices)
        elif len(boxes) != len(sample_indices):
            raise ValueError(f"fork: {len(sample_indices)} branches but {len(boxes)} sandboxes")
        try:
            fork(len(boxes), children=boxes)
            for child, box in zip(children, boxes, strict=True):
                child._sandbox = child._owned = box
                child._continue(self, getattr(box, "fork_info", None))
        except BaseException:
            for box in boxes:
                with contextlib.suppress(Exception):
                    box.close()
            raise
        return children

    def _continue(self, parent: SteppedEpisode, info: Any) -> None:
        """Start as `parent`'s continuation (fork): its history, its clock, recorded now."""
        src, ep = parent._ep, self._ep
        lineage = {
            "parent_run_id": parent.record.run_id,
            "parent_episode_id": parent.record.episode_id,
            "branch_turn": len(src.turns),
            "branch_kind": "fork",
        }
        carried = {
            "processes_not_carried": list(getattr(info, "processes_not_carried", []))[:5],
            "process_count": getattr(info, "process_count", 0),
            "files_bytes": getattr(info, "files_bytes", 0),
            "seconds": round(getattr(info, "seconds", 0.0), 4),
        }
        prefix = EpisodePrefix(
            prompt_messages=parent.record.prompt_messages,
            messages=src.messages,
            turns=src.turns,
            lineage=lineage,
            config={"fork": carried},
        )
        take_prefix(ep, prefix)
        ep.t0, ep.deadline, ep.max_tokens = src.t0, src.deadline, src.max_tokens
        ep.cancel = src.cancel
        for tag in ("training_run", "training_step", "policy_version"):  # the same rollout
            setattr(self.record, tag, getattr(parent.record, tag))
        self._started = True
        self.recorder.start_episode(self.record)
        for turn in ep.turns:
            self.recorder.record_turn(turn)
        assert self._sandbox is not None
        ep.watch_egress(self._sandbox)  # its inputs and clock are the parent's
        self._wait_for_policy(ToolBox(self._sandbox, self.limits.max_observation_chars))
        self._mark = (time.monotonic(), now())

    def _wait_for_policy(self, toolbox: ToolBox) -> None:
        """The loop (tasks/react.py) from this episode's next turn, stopped at its first
        `yield`: each `step` sends it the policy's reply."""
        self._loop = react(self._ep, toolbox, len(self._ep.turns), policy=True)
        next(self._loop)

    def _abort(self) -> None:
        """A bug, or the recorder failed: never leak the sandbox."""
        self._finished = True
        if self._owned is not None:
            with contextlib.suppress(Exception):
                self._owned.close()
