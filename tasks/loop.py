"""One episode: a model, a sandbox, a task, and the ReAct loop between them.

The loop, in one sitting (mini-swe-agent style)::

    messages = [system, instance]                     # the prefix every request extends
    for step in range(max_steps):
        reply = model(messages, tools)                # retries inside; infra errors end it
        messages.append(reply)                        # append-only: never edited later
        if no tool calls: messages.append(continue prompt)
        for each tool call, in order: messages.append(its own tool result)
        record the turn
        if submit was called: stop
    answer = output/answer.txt (fallbacks: submit's argument, the last message)

Exactly one termination reason per episode (records.Termination). Infrastructure
failures (model_error, sandbox_error, interrupted) are told apart from the model's
own (max_steps, context_exhausted, wall_clock) so they can be retried, not graded.

`run_episode` is the entry point the flows call from a Prefect task (one task per
episode). `mode="llm"` runs the paper's baseline through the same records.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from datasets_prep.task import Task, check_runnable
from sandbox.base import Sandbox, SandboxConfig, SandboxError, SandboxLimits
from sandbox.engine import engine_of, shown_address
from tasks.answers import extract_answer
from tasks.defaults import DEFAULT_MAX_STEPS, DEFAULT_WALL_CLOCK_S
from tasks.model import ContextLengthError, ModelClient, ModelConfig, ModelError, ModelReply
from tasks.prompts import PromptSet, load_prompts
from tasks.records import (
    EgressRequest,
    EpisodeRecord,
    Mode,
    NullRecorder,
    Observation,
    Recorder,
    Termination,
    TurnRecord,
    episode_key,
    episode_totals,
)
from tasks.tools import TOOL_SCHEMAS, ToolBox, clip_bytes

log = logging.getLogger("sandflow.episode")

# A live view (the CLI) gets these events: ("request", turn_index) before each model
# call, ("reply", TurnRecord) after it, ("tool", ToolCall) before each tool call,
# ("observation", Observation) after it, ("end", EpisodeRecord).
EventHook = Callable[[str, Any], None]


class CancelCheck(Protocol):
    """What the loop needs of a cancel token (engine.cancel.CancelToken has it)."""

    def is_set(self) -> bool: ...


MAX_CONTEXT_SHRINKS = 4


class Limits(BaseModel):
    """Bounds of one episode. The first one reached ends it with its own reason."""

    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1, description="model calls (turns) per episode")
    context_tokens: int | None = Field(
        None, ge=256, description="budget for one request's prompt + completion tokens"
    )
    max_tokens_per_call: int | None = Field(None, ge=1, description="overrides the model's max_tokens")
    wall_clock_s: float | None = Field(
        DEFAULT_WALL_CLOCK_S, gt=0, description="the model's calls and commands (a hung endpoint: model_error)"
    )
    exec_timeout_s: float | None = Field(None, gt=0, description="per command; default: the sandbox's")
    max_observation_chars: int = Field(16_000, ge=200, description="one tool result, clipped in the middle")
    # One message may carry any number of tool calls (a policy's raw text, a hostile
    # model): these bound what one turn can cost. Calls past either bound are not run;
    # each still gets a short error result, so the chat stays valid and the model can
    # read why (docs/episodes.md, "Bounds of a turn").
    max_tool_calls_per_turn: int = Field(
        32, ge=1, description="tool calls run per assistant message; the rest answered with an error"
    )
    max_observation_bytes_per_turn: int = Field(
        262_144, ge=1024, description="UTF-8 bytes of tool results per turn; later calls are not run"
    )


@dataclass
class EpisodeResult:
    """What `run_episode` hands back (everything is also sent to the recorder)."""

    record: EpisodeRecord
    turns: list[TurnRecord]
    messages: list[dict[str, Any]]  # the full, append-only history
    output_files: list[Path] = field(default_factory=list)


@dataclass
class EpisodePrefix:
    """Where an episode starts when it continues another one (tasks.replay): the turns
    already taken (the parent's, recorded again under the new episode's ids), the
    history they make, and the lineage the record carries. The sandbox handed to
    run_episode already holds the state those turns left (inputs placed)."""

    prompt_messages: list[dict[str, Any]]  # the parent's system + task messages
    messages: list[dict[str, Any]]  # prompt_messages + every message of `turns`
    turns: list[TurnRecord]
    lineage: dict[str, Any]  # parent_run_id, parent_episode_id, branch_turn, branch_kind
    config: dict[str, Any] = field(default_factory=dict)  # merged into record.config


class _End(Exception):
    """Internal: stop the loop with this termination reason."""

    def __init__(self, reason: Termination, error: str | None = None) -> None:
        super().__init__(reason)
        self.reason: Termination = reason
        self.error = error


def _now() -> datetime:
    return datetime.now(UTC)


def run_episode(
    task: Task,
    model_cfg: ModelConfig,
    sandbox_cfg: SandboxConfig | None = None,
    recorder: Recorder | None = None,
    *,
    mode: Mode = "sandbox",
    sample_index: int = 0,
    run_id: str = "adhoc",
    limits: Limits | None = None,
    sandbox: Sandbox | None = None,
    client: ModelClient | None = None,
    output_dir: Path | str | None = None,
    prompt_dir: str | None = None,
    on_event: EventHook | None = None,
    cancel: CancelCheck | None = None,
    prefix: EpisodePrefix | None = None,
) -> EpisodeResult:
    """Run one episode of `task` and record it; never raises for model or sandbox failures.

    Args:
        task: the question; its `input_files` are written to the prompt's input dir.
        model_cfg: endpoint and sampling (its API key is never recorded).
        sandbox_cfg: how to open the sandbox (mode="sandbox"); ignored when `sandbox` is given.
        recorder: receives start_episode / record_turn (after every turn) / finish_episode.
        mode: "sandbox" (tools in a sandbox) or "llm" (one call, documents inline, no tools).
        sample_index, run_id: with task.id and mode they make the episode id (records.episode_key).
        limits: max steps, context budget, tokens per call, wall clock, exec timeout.
        sandbox: an already open sandbox to use (left open); otherwise one is opened and closed.
        client: a ModelClient to reuse (connection pooling across episodes).
        output_dir: if set, the sandbox's output directory is copied here at the end.
        prompt_dir: a folder of prompt YAML files overriding the packaged ones.
        on_event: live-view hook, see EventHook.
        cancel: the run's cancel token (engine.cancel.CancelToken; anything with
            `is_set()`), checked after every model reply and tool call: once set, the
            episode ends as `interrupted` at that point (recorded, sandbox closed) and
            returns; as `budget_exhausted` when the token says so (`termination`: the
            run's budget was reached, engine.budget). A sandbox or model failure while it is set (the canceller removed the
            sandbox or closed the client under us) is `interrupted` too, not infrastructure.
        prefix: continue from these turns (tasks.replay): mode "sandbox" and `sandbox`
            (its state already rebuilt) are required; the model is first asked at turn
            len(prefix.turns), and `limits.max_steps` counts the prefix's turns too.

    Raises:
        KeyboardInterrupt: after recording the episode as "interrupted".
    """
    limits = limits or Limits()
    recorder = recorder or NullRecorder()
    prompts, messages, record = _prepare(
        task, model_cfg, sandbox_cfg, limits, mode, sample_index, run_id, prompt_dir, sandbox
    )
    episode = _Episode(
        task, model_cfg, prompts, limits, record, recorder, messages, on_event, client
    )
    episode.cancel = cancel
    if prefix is not None:
        if mode != "sandbox" or sandbox is None:
            raise ValueError("run_episode(prefix=...) needs mode 'sandbox' and the rebuilt sandbox")
        _take_prefix(episode, prefix)
    recorder.start_episode(record)
    for turn in episode.turns:  # a prefix's turns, recorded as this episode's
        recorder.record_turn(turn)
    owned: Sandbox | None = None
    try:
        if mode == "llm":
            episode.run_llm()
        else:
            if sandbox is None:
                owned = sandbox = _open_sandbox(_sandbox_config(sandbox_cfg, record, task))
            episode.run_sandbox(sandbox, output_dir, start=len(episode.turns))
    except _End as end:
        episode.end(end, sandbox)
    except KeyboardInterrupt:
        record.termination, record.error = "interrupted", "interrupted by the user (Ctrl+C)"
        episode.finish(owned)
        raise
    except BaseException:  # a bug, or the recorder failed: never leak the sandbox
        if owned is not None:
            with contextlib.suppress(Exception):
                owned.close()
        raise
    episode.finish(owned)
    return EpisodeResult(record, episode.turns, messages, episode.output_files)


class SteppedEpisode:
    """An episode whose assistant turns come from outside: an RL trainer's policy.

    The trainer owns generation; this owns the sandbox, the tools, the limits and the
    records, through the same `_Episode` that run_episode drives (one turn: `_Episode.act`)::

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
        prompts, messages, record = _prepare(
            task, model_cfg, sandbox_cfg, self.limits, "sandbox", sample_index, run_id, prompt_dir,
            sandbox,
        )
        self._ep = _Episode(
            task, model_cfg, prompts, self.limits, record, self.recorder, messages, None, client
        )
        self._prompt_dir = prompt_dir
        self._sandbox_cfg = sandbox_cfg
        self._sandbox = sandbox
        self._owned: Sandbox | None = None
        self._toolbox: ToolBox | None = None
        self._output_dir = output_dir
        self._started = self._finished = False
        self._mark = (time.monotonic(), _now())  # when the policy got its last observation

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
                cfg = _sandbox_config(self._sandbox_cfg, self.record, self._ep.task)
                self._owned = self._sandbox = _open_sandbox(cfg)
            self._ep.watch_egress(self._sandbox)
            self._ep._place_inputs(self._sandbox)
            self._toolbox = ToolBox(self._sandbox, self.limits.max_observation_chars)
            if self.limits.wall_clock_s:  # as run_sandbox: opening the sandbox is not the policy's time
                self._ep.deadline = time.monotonic() + self.limits.wall_clock_s
        except _End as end:
            self._ep.end(end, self._sandbox)
        except BaseException:
            self._abort()
            raise
        self._mark = (time.monotonic(), _now())
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
        assert self._toolbox is not None
        ep = self._ep
        before = len(ep.messages)
        since, started = self._mark
        if not reply.latency_s:  # the policy's generation, as the loop times a model call
            reply.latency_s = time.monotonic() - since
        try:
            ep.act(self._toolbox, len(ep.turns), started, reply)
            if len(ep.turns) >= self.limits.max_steps:
                raise _End("max_steps", f"no submit within {self.limits.max_steps} steps")
            left = ep.remaining()
            if left is not None and left <= 0:
                raise _End("wall_clock", f"episode wall clock of {self.limits.wall_clock_s:g}s reached")
            ep.next_max_tokens()  # the context budget, when the reply carried its usage
        except _End as end:
            ep.end(end, self._sandbox)
        except KeyboardInterrupt:
            self.record.termination = "interrupted"
            self.record.error = "interrupted by the user (Ctrl+C)"
            self.finish()
            raise
        except BaseException:
            self._abort()
            raise
        self._mark = (time.monotonic(), _now())
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
            self._ep.end(_End(reason, error or "the trainer ended the episode"), self._sandbox)
        if self._sandbox is not None and self._started:
            self._ep._collect(self._sandbox, self._output_dir)
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
            return self._ep.ask(TOOL_SCHEMAS)
        except _End as end:
            self._ep.end(end, self._sandbox)
            return None

    def open_branches(self, sample_indices: list[int]) -> list[Sandbox]:
        """The sandboxes a later `fork(sample_indices, boxes=...)` writes into, opened now
        (e.g. in another thread while this episode runs on: the branch point then costs
        the copy only), each labelled with its branch's episode. SandboxError on failure."""
        base = _sandbox_config(self._sandbox_cfg, self.record, self._ep.task)
        run, task = self.record.run_id, self._ep.task.id
        return _open_sandboxes(
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
        _take_prefix(ep, prefix)
        ep.t0, ep.deadline, ep.max_tokens = src.t0, src.deadline, src.max_tokens
        ep.cancel = src.cancel
        for tag in ("training_run", "training_step", "policy_version"):  # the same rollout
            setattr(self.record, tag, getattr(parent.record, tag))
        self._started = True
        self.recorder.start_episode(self.record)
        for turn in ep.turns:
            self.recorder.record_turn(turn)
        assert self._sandbox is not None
        ep.watch_egress(self._sandbox)
        self._toolbox = ToolBox(self._sandbox, self.limits.max_observation_chars)
        self._mark = (time.monotonic(), _now())

    def _abort(self) -> None:
        """A bug, or the recorder failed: never leak the sandbox."""
        self._finished = True
        if self._owned is not None:
            with contextlib.suppress(Exception):
                self._owned.close()


def _take_prefix(episode: _Episode, prefix: EpisodePrefix) -> None:
    """Start `episode` where `prefix` ends: its history, its turns (under this episode's
    ids), its lineage; the context budget counts from the prefix's last request."""
    record = episode.record
    episode.messages[:] = [dict(m) for m in prefix.messages]
    record.prompt_messages = [dict(m) for m in prefix.prompt_messages]
    for name, value in prefix.lineage.items():
        setattr(record, name, value)
    record.config = {**record.config, **prefix.config}
    ids = {"run_id": record.run_id, "episode_id": record.episode_id}
    episode.turns = [t.model_copy(update=ids, deep=True) for t in prefix.turns]
    last = next((t.usage for t in reversed(episode.turns) if t.usage.prompt_tokens is not None), None)
    if last is not None:
        episode.last_total_tokens = (last.prompt_tokens or 0) + (last.completion_tokens or 0)


def load_task_prompts(task: Task, prompt_dir: str | None) -> PromptSet:
    """The prompts of `task`'s domain (a task may name its own input directory)."""
    prompts = load_prompts(task.domain, prompt_dir)
    if task.metadata.get("input_dir"):
        prompts = PromptSet(prompts.domain, {**prompts.values, "input_dir": str(task.metadata["input_dir"])})
    return prompts


def place_inputs(sandbox: Sandbox, prompts: PromptSet, task: Task) -> None:
    """The task's directories and input files in the sandbox; SandboxError if that fails."""
    dirs = " ".join(shlex.quote(d) for d in (prompts.working_dir, prompts.input_dir, prompts.output_dir))
    r = sandbox.exec(f"mkdir -p {dirs}", timeout=60)
    if r.exit_code != 0:
        raise SandboxError(f"mkdir of the task directories failed: {r.stderr.strip()}")
    for name, data in task.input_files.items():
        sandbox.write_file(posixpath.join(prompts.input_dir, name), data)  # parents created


def _prepare(
    task: Task,
    model_cfg: ModelConfig,
    sandbox_cfg: SandboxConfig | None,
    limits: Limits,
    mode: Mode,
    sample_index: int,
    run_id: str,
    prompt_dir: str | None,
    sandbox: Sandbox | None = None,
) -> tuple[PromptSet, list[dict[str, Any]], EpisodeRecord]:
    """The prompts, the first messages and the record of a new episode (nothing started);
    a sandbox handed in names the engine, else the config it will be opened with."""
    _check_task(task)
    prompts = load_task_prompts(task, prompt_dir)
    episode_id = episode_key(run_id, task.id, mode, sample_index)
    messages = prompts.llm_messages(task) if mode == "llm" else prompts.sandbox_messages(task)
    record = EpisodeRecord(
        run_id=run_id,
        episode_id=episode_id,
        task_id=task.id,
        domain=task.domain,
        mode=mode,
        sample_index=sample_index,
        model=model_cfg.model,
        started_at=_now(),
        prompt_messages=[dict(m) for m in messages],
        config=_public_config(model_cfg, limits, sandbox_cfg, mode),
        worker_host=socket.gethostname(),
        sandbox_engine=(
            _engine_of(getattr(sandbox, "config", None) or sandbox_cfg) if mode == "sandbox" else None
        ),
    )
    return prompts, messages, record


def _check_task(task: Task) -> None:
    """Bad input is the caller's error: say which task and which file, before starting.

    The task is re-validated whoever built it (`Task.model_construct` skips validation):
    names, sizes, UTF-8, and no secret of the environment goes into a sandbox or a record."""
    for name, data in task.input_files.items():
        parts = Path(name).parts
        if not name or name.startswith("/") or ".." in parts:
            raise ValueError(
                f"task {task.id!r}: input file name {name!r} must be a relative path "
                "inside the input directory (no leading '/', no '..')"
            )
        if not isinstance(data, (str, bytes)):
            raise ValueError(
                f"task {task.id!r}: input file {name!r} must be str or bytes, got {type(data).__name__}"
            )
    check_runnable(task)


def _engine_of(sandbox_cfg: SandboxConfig | None) -> str:
    cfg = sandbox_cfg if isinstance(sandbox_cfg, SandboxConfig) else SandboxConfig()
    return engine_of(cfg.backend, cfg.docker_host, cfg.runtime)


def _sandbox_config(
    sandbox_cfg: SandboxConfig | None, record: EpisodeRecord, task: Task
) -> SandboxConfig:
    """The sandbox's config, labelled with the episode it belongs to (gc finds it by label).

    A task's `metadata["network"]` (e.g. "allowlist:pypi.org *.pythonhosted.org:443")
    overrides the run's network policy for its episodes."""
    cfg = sandbox_cfg or SandboxConfig()
    update: dict[str, Any] = {"run_id": record.run_id, "episode_id": record.episode_id}
    spec = task.metadata.get("network")
    if spec is not None:
        try:
            update["limits"] = SandboxLimits.model_validate(
                {**cfg.limits.model_dump(exclude={"network", "egress_allow"}), "network": spec}
            )
        except (ValueError, TypeError) as exc:
            raise _End(
                "sandbox_error", f"task {task.id}: metadata.network {str(spec)[:200]!r}: {exc}"
            ) from None
    return cfg.model_copy(update=update)


def _open_sandboxes(cfgs: list[SandboxConfig]) -> list[Sandbox]:
    """One sandbox per config (a fork's children): docker's in parallel, bwrap's in this
    thread (its --die-with-parent is the starting thread's). SandboxError if one fails
    (the others are closed)."""
    import sandbox as sandbox_pkg

    boxes: list[Sandbox] = []
    errors: list[Exception] = []
    from sandbox.backends import capabilities

    if len(cfgs) > 1 and all(capabilities(c.backend).parallel_open for c in cfgs):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(cfgs), thread_name_prefix="sandflow-fork-open") as pool:
            futures = [pool.submit(sandbox_pkg.acquire, c) for c in cfgs]
        for f in futures:
            try:
                boxes.append(f.result())
            except Exception as exc:  # noqa: BLE001 - raised below, after the closes
                errors.append(exc)
    else:
        for c in cfgs:
            try:
                boxes.append(sandbox_pkg.acquire(c))
            except Exception as exc:  # noqa: BLE001 - raised below, after the closes
                errors.append(exc)
                break
    if not errors:
        return boxes
    for box in boxes:
        with contextlib.suppress(Exception):
            box.close()
    raise SandboxError(f"could not open a fork's sandbox: {errors[0]}") from errors[0]


def _open_sandbox(cfg: SandboxConfig) -> Sandbox:
    import sandbox as sandbox_pkg

    try:
        return sandbox_pkg.acquire(cfg)  # cfg.reuse: the warm pool or a fresh sandbox
    except SandboxError as exc:
        raise _End("sandbox_error", f"could not open the sandbox: {exc}") from None
    except Exception as exc:  # engine unreachable, image missing: infrastructure
        raise _End("sandbox_error", f"could not open the sandbox: {type(exc).__name__}: {exc}") from None


def _public_config(
    model_cfg: ModelConfig, limits: Limits, sandbox_cfg: SandboxConfig | None, mode: str
) -> dict[str, Any]:
    cfg: dict[str, Any] = {"mode": mode, "model": model_cfg.public_dict(), "limits": limits.model_dump()}
    if sandbox_cfg is not None and mode == "sandbox":
        sb = sandbox_cfg.model_dump(mode="json")
        sb["env"] = sorted(sb.get("env", {}))  # names only: values may be secrets
        if sb.get("docker_host"):
            sb["docker_host"] = shown_address(sb["docker_host"])
        cfg["sandbox"] = sb
    return cfg


class TurnBudget:
    """What one turn's tool calls may cost: `max_tool_calls_per_turn` calls run, and their
    results together hold at most `max_observation_bytes_per_turn` UTF-8 bytes.

    The result that crosses the byte budget is clipped to what is left (head and tail,
    with a notice); every call after the budget is spent, or past the call cap, is not
    run and is answered with a one-line error instead (its cost is proportional to the
    call the message sent, itself bounded by the reply's size).
    """

    def __init__(self, limits: Limits, calls: int) -> None:
        self.max_calls = limits.max_tool_calls_per_turn
        self.max_bytes = limits.max_observation_bytes_per_turn
        self.calls = calls
        self.ran = 0
        self.used = 0

    def refusal(self) -> tuple[str, str] | None:
        """(error label, the model's message) for a call that must not run; None: run it."""
        if self.ran >= self.max_calls:
            return (
                "over the tool-call limit",
                f"Not executed: at most {self.max_calls} tool calls run per message "
                f"({self.calls} were sent). Send the others in your next message.",
            )
        if self.used >= self.max_bytes:
            return (
                "over the observation budget",
                f"Not executed: this message's tool results reached {self.max_bytes} bytes. "
                "Call it again in your next message, with less output.",
            )
        return None

    def charge(self, obs: Observation) -> None:
        """Count a call that ran; clip its result to the bytes left in the turn."""
        self.ran += 1
        left = self.max_bytes - self.used
        obs.content, clipped = clip_bytes(
            obs.content, left, f"this message's tool results reached {self.max_bytes} bytes"
        )
        obs.truncated = obs.truncated or clipped
        self.used += len(obs.content.encode("utf-8"))


class _Episode:
    """The state of one running episode; methods are the loop's steps."""

    def __init__(
        self,
        task: Task,
        model_cfg: ModelConfig,
        prompts: PromptSet,
        limits: Limits,
        record: EpisodeRecord,
        recorder: Recorder,
        messages: list[dict[str, Any]],
        on_event: EventHook | None,
        client: ModelClient | None,
    ) -> None:
        self.task, self.prompts, self.limits = task, prompts, limits
        self.model_cfg = model_cfg
        self.record, self.recorder, self.messages = record, recorder, messages
        self._on_event = on_event
        self.cancel: CancelCheck | None = None
        self._client = client
        self._own_client = client is None
        self.turns: list[TurnRecord] = []
        self.output_files: list[Path] = []
        self.t0 = time.monotonic()
        self.deadline = self.t0 + limits.wall_clock_s if limits.wall_clock_s else None
        self.max_tokens = limits.max_tokens_per_call or model_cfg.max_tokens
        self.last_total_tokens: int | None = None
        self.submit_args: dict[str, Any] = {}
        self._egress_box: Any = None  # a sandbox behind the egress proxy (network allowlist)
        self._egress_since = 0.0

    def on_event(self, kind: str, payload: Any) -> None:
        """Tell the live view; between steps, stop here when the run was cancelled."""
        if kind != "end" and self.cancel is not None and self.cancel.is_set():
            reason = getattr(self.cancel, "reason", None) or "the run was stopped"
            if getattr(self.cancel, "termination", None) != "budget_exhausted":
                raise _End("interrupted", f"cancelled: {reason}")
            if kind == "request":  # a spent budget stops at the turn boundary: the paid
                raise _End("budget_exhausted", reason)  # reply's tools run and it is recorded
        if self._on_event is not None:
            self._on_event(kind, payload)

    def watch_egress(self, sandbox: Sandbox) -> None:
        """Record the sandbox's requests through the egress proxy with the turns from now on
        (each in the turn during which it ended); a no-op for sandboxes without one."""
        if getattr(sandbox, "egress", None) is not None and callable(
            getattr(sandbox, "egress_records", None)
        ):
            self._egress_box, self._egress_since = sandbox, time.time()

    def _take_egress(self) -> list[EgressRequest]:
        if self._egress_box is None:
            return []
        until = time.time()
        try:
            found = self._egress_box.egress_records(self._egress_since, until)
        except Exception as exc:  # noqa: BLE001 - the proxy's log is a record, not the episode
            log.warning("egress records of episode %s: %s", self.record.episode_id, exc)
            return []
        self._egress_since = until
        return [
            EgressRequest(
                time=datetime.fromtimestamp(r.time, UTC),
                method=r.method,
                host=r.host,
                port=r.port,
                url=r.url if r.url and r.method != "CONNECT" else None,
                status=r.status or None,
                bytes_out=r.bytes_out,
                bytes_in=r.bytes_in,
                allowed=r.allowed,
                rule=r.rule,
                result=r.result,
            )
            for r in found
        ]

    @property
    def client(self) -> ModelClient:
        if self._client is None:
            self._client = ModelClient(self.model_cfg)
        return self._client

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    # -- the model call ----------------------------------------------------------
    def ask(self, tools: list[dict] | None) -> ModelReply:
        """One model call within the limits; context errors shrink max_tokens first."""
        for _ in range(MAX_CONTEXT_SHRINKS + 1):
            left = self.remaining()
            if left is not None and left <= 0:
                raise _End("wall_clock", f"episode wall clock of {self.limits.wall_clock_s:g}s reached")
            max_tokens = self.next_max_tokens()
            t_call = time.monotonic()
            try:
                reply = self.client.complete(self.messages, tools, max_tokens, timeout_s=left)
                reply.max_tokens_used = max_tokens
            except ContextLengthError as exc:
                self.max_tokens = self._shrunk(max_tokens, exc)
                continue
            except ModelError as exc:
                raise _End("model_error", self._waited(t_call, str(exc))) from None
            if (left := self.remaining()) is not None and left <= 0:
                raise _End("model_error", self._waited(t_call, "the reply came only then")) from None
            return reply
        raise _End("context_exhausted", "the request still does not fit after shrinking max_tokens")

    def _waited(self, t_call: float, detail: str) -> str:
        """The error of a model call; names the wall clock when it ran out during the call.

        The wall clock is charged to whoever holds the episode when it runs out. While
        the loop waits for the endpoint (a request in flight, a retry's backoff, a reply
        that comes late), that is the endpoint, not the model's work in the sandbox: an
        endpoint that hangs until the deadline is an infrastructure failure (model_error:
        retried, re-run on resume), never a graded `wall_clock`.
        """
        left = self.remaining()
        if left is None or left > 0:
            return detail
        return (
            f"the model endpoint did not answer before the episode's wall clock "
            f"({self.limits.wall_clock_s:g}s) ran out; waited {time.monotonic() - t_call:.1f}s for "
            f"this call: {detail}. Not graded; if the model is slow rather than stuck, raise "
            "--wall-clock"
        )

    def next_max_tokens(self) -> int:
        """max_tokens for the next call within the context budget; _End when it is used up."""
        max_tokens = self.max_tokens
        budget = self.limits.context_tokens
        if budget is not None and self.last_total_tokens is not None:
            max_tokens = min(max_tokens, budget - self.last_total_tokens)
            if max_tokens < self.model_cfg.min_max_tokens:
                raise _End(
                    "context_exhausted",
                    f"context budget of {budget} tokens used up "
                    f"({self.last_total_tokens} in the last request)",
                )
        return max_tokens

    def _shrunk(self, max_tokens: int, exc: ContextLengthError) -> int:
        if exc.max_context and exc.prompt_tokens:
            new = exc.max_context - exc.prompt_tokens - 8
        else:
            new = max_tokens // 2
        new = min(new, max_tokens - 1)
        if new < self.model_cfg.min_max_tokens:
            raise _End("context_exhausted", f"the model's context is full: {exc}")
        return new

    def _turn(self, index: int, started: datetime, reply: ModelReply) -> TurnRecord:
        usage = reply.usage
        if usage.prompt_tokens is not None:
            self.last_total_tokens = usage.prompt_tokens + (usage.completion_tokens or 0)
        return TurnRecord(
            run_id=self.record.run_id,
            episode_id=self.record.episode_id,
            turn_index=index,
            started_at=started,
            assistant_content=reply.content,
            reasoning_content=reply.reasoning_content,
            tool_calls=reply.tool_calls,
            finish_reason=reply.finish_reason,
            model_latency_s=reply.latency_s,
            usage=usage,
            prompt_token_ids=reply.prompt_token_ids,
            completion_token_ids=reply.completion_token_ids,
            completion_logprobs=reply.completion_logprobs,
            request_max_tokens=reply.max_tokens_used,
            attempts=reply.attempts,
        )

    def _record(self, turn: TurnRecord) -> None:
        turn.egress = self._take_egress()
        self.turns.append(turn)
        self.recorder.record_turn(turn)

    # -- sandbox mode ------------------------------------------------------------
    def run_sandbox(self, sandbox: Sandbox, output_dir: Path | str | None, start: int = 0) -> None:
        """The loop from turn `start` (0: a new episode, its inputs placed first)."""
        try:
            self.watch_egress(sandbox)
            if start == 0:
                self._place_inputs(sandbox)
            toolbox = ToolBox(sandbox, self.limits.max_observation_chars)
            # The wall clock is the model's time (its calls and its commands): opening the
            # sandbox and placing the inputs (a busy engine) must not use it up.
            if self.limits.wall_clock_s:
                self.deadline = time.monotonic() + self.limits.wall_clock_s
            self._loop(toolbox, start)
        finally:
            self._collect(sandbox, output_dir)

    def _place_inputs(self, sandbox: Sandbox) -> None:
        try:
            place_inputs(sandbox, self.prompts, self.task)
        except SandboxError as exc:
            raise _End("sandbox_error", f"placing the task's input files failed: {exc}") from None

    def _loop(self, toolbox: ToolBox, start: int = 0) -> None:
        for step in range(start, self.limits.max_steps):
            started = _now()
            self.on_event("request", step)
            reply = self.ask(TOOL_SCHEMAS)
            self.act(toolbox, step, started, reply)
        raise _End("max_steps", f"no submit within {self.limits.max_steps} steps")

    def act(self, toolbox: ToolBox, step: int, started: datetime, reply: ModelReply) -> TurnRecord:
        """One turn once the model has replied: append the reply, run every tool call in
        order (each answered in its own tool message), record the turn.

        Raises _End("submitted") after a submit, and _End for a limit or a broken sandbox.
        """
        self.messages.append(reply.as_message())
        turn = self._turn(step, started, reply)
        self.on_event("reply", turn)
        if not reply.tool_calls:
            nudge = self.prompts.continue_message()
            self.messages.append(nudge)
            turn.extra_messages.append(nudge)
        submitted = False
        budget = TurnBudget(self.limits, len(reply.tool_calls))
        t_tools = time.perf_counter()
        for call in reply.tool_calls:
            refusal = (
                ("not executed after submit", "Not executed: submit already ended the task.")
                if submitted
                else budget.refusal()
            )
            if refusal is not None:  # still answered, so every call has its result
                skipped = Observation(
                    tool_call_id=call.id, name=call.name, error=refusal[0], content=refusal[1]
                )
                turn.observations.append(skipped)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": skipped.content})
                continue
            self.on_event("tool", call)
            result = self._call_tool(toolbox, call, turn)
            obs = result.observation
            budget.charge(obs)
            turn.observations.append(obs)
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": obs.content})
            self.on_event("observation", obs)
            if result.submitted:
                submitted, self.submit_args = True, result.submit_args
        turn.tool_latency_s = time.perf_counter() - t_tools
        self._record(turn)
        if submitted:
            raise _End("submitted")
        return turn

    def _call_tool(self, toolbox: ToolBox, call: Any, turn: TurnRecord) -> Any:
        left = self.remaining()
        if left is not None and left <= 0:
            self._record(turn)
            raise _End("wall_clock", f"episode wall clock of {self.limits.wall_clock_s:g}s reached")
        timeout = self.limits.exec_timeout_s or toolbox.sandbox.config.limits.exec_timeout_s
        if left is not None:
            timeout = max(1.0, min(timeout, left))
        try:
            return toolbox.call(call, timeout)
        except SandboxError as exc:
            if type(exc).__name__ == "SandboxExpired":  # the sandbox's own lifetime: a time limit
                self._record(turn)
                raise _End("wall_clock", f"the sandbox's lifetime ran out: {exc}") from None
            turn.error = f"sandbox error in {call.name}: {exc}"
            self._record(turn)
            raise _End("sandbox_error", turn.error) from None
        except Exception as exc:  # the engine's own errors (docker/requests): infrastructure
            turn.error = f"sandbox failure in {call.name}: {type(exc).__name__}: {exc}"
            self._record(turn)
            raise _End("sandbox_error", turn.error) from None

    def _collect(self, sandbox: Sandbox, output_dir: Path | str | None) -> None:
        """The answer (file, then submit's argument, then the last message) and the outputs."""
        answer: str | None = self._read_answer_file(sandbox)
        source: str | None = "answer_file"
        if answer is None:
            arg = self.submit_args.get("answer") or self.submit_args.get("result")
            answer, source = (str(arg).strip(), "submit_argument") if arg else (None, None)
        if answer is None:
            last = next((t.assistant_content for t in reversed(self.turns) if t.assistant_content), None)
            answer = extract_answer(last)
            source = "last_message" if answer is not None else None
        self.record.answer, self.record.answer_source = answer, source
        self._read_usage(sandbox)
        if output_dir is not None:
            try:
                Path(output_dir).mkdir(parents=True, exist_ok=True)
                self.output_files = sandbox.copy_out(self.prompts.output_dir, output_dir)
                summary = getattr(self.output_files, "summary", None)  # one account, not N warnings
                self.record.output_export = summary.as_dict() if summary is not None else None
            except Exception as exc:  # a lost output copy must not hide the episode's result
                self.record.error = f"{self.record.error or ''} [copying outputs failed: {exc}]".strip()

    def _read_usage(self, sandbox: Sandbox) -> None:
        """CPU-seconds and peak memory from the sandbox's cgroup (sandbox/usage.py), read
        before it is closed or handed back to its pool; a backend without the counters
        leaves them unknown."""
        if not sandbox.capabilities.usage:
            return
        usage = sandbox.resource_usage()
        self.record.sandbox_cpu_s = getattr(usage, "cpu_s", None)
        self.record.sandbox_peak_memory_bytes = getattr(usage, "peak_memory_bytes", None)

    def _read_answer_file(self, sandbox: Sandbox) -> str | None:
        try:
            data = sandbox.read_file(self.prompts.answer_path)
        except Exception:  # missing file, or the sandbox is gone
            return None
        text = data.decode("utf-8", errors="replace").strip()
        return text or None

    # -- LLM mode ----------------------------------------------------------------
    def run_llm(self) -> None:
        started = _now()
        self.on_event("request", 0)
        reply = self.ask(None)
        self.messages.append(reply.as_message())
        turn = self._turn(0, started, reply)
        self.on_event("reply", turn)
        self._record(turn)
        self.record.answer = extract_answer(reply.content, self.prompts.llm_answer)
        self.record.answer_source = "reply" if self.record.answer is not None else None
        raise _End("submitted")

    # -- the end -------------------------------------------------------------------
    def end(self, end: _End, sandbox: Sandbox | None) -> None:
        """Take the termination reason; notes added on the way out (e.g. a failed output
        copy) are kept."""
        r = self.record
        r.termination = end.reason
        r.error = " ".join(x for x in (end.error, r.error) if x) or None
        if end.reason == "sandbox_error" and getattr(sandbox, "killed_by_signal", None):
            # Ctrl+C / SIGTERM removed the sandbox under us: the user stopped the run.
            r.termination = "interrupted"
        if end.reason in ("sandbox_error", "model_error") and self.cancel is not None and self.cancel.is_set():
            # The canceller removed the sandbox or closed the model client under us.
            r.termination = "interrupted"

    def finish(self, owned: Sandbox | None) -> None:
        r = self.record
        if r.termination is None:  # defensive: every path above sets one
            r.termination, r.error = "sandbox_error", r.error or "episode ended without a reason"
        r.ended_at = _now()
        r.wall_s = time.monotonic() - self.t0
        for name, value in episode_totals(self.turns).items():
            setattr(r, name, value)
        if owned is not None:
            try:
                owned.close()
            except Exception as exc:
                r.error = (r.error or "") + f" [closing the sandbox failed: {exc}]"
        if self._own_client and self._client is not None:
            self._client.close()
        self.recorder.finish_episode(r)
        self.on_event("end", r)
