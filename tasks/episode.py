"""The state of one running episode and the steps the loop takes on it.

`Episode` holds what an episode has so far (its messages, turns, record, clock, context
budget) and does the steps of a turn that are more than a line: ask the model within the
limits (`ask`), run one tool call (`call_tool`), record a turn, read the answer at the end
(`collect`) and close it (`end`, `finish`). The loop itself, which calls them in order, is
tasks/react.py; `run_episode` (tasks/loop.py) and `SteppedEpisode` (tasks/stepped.py)
drive it. `End` is how any step stops the episode with its one termination reason.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from datasets_prep.task import Task, check_runnable
from sandbox.base import Sandbox, SandboxConfig, SandboxError
from sandbox.engine import engine_of, shown_address
from tasks.answers import extract_answer
from tasks.budgets import MAX_CONTEXT_SHRINKS, Limits
from tasks.model import ContextLengthError, ModelClient, ModelConfig, ModelError, ModelReply
from tasks.prompts import PromptSet, load_prompts
from tasks.records import (
    EgressRequest,
    EpisodeRecord,
    Mode,
    Recorder,
    Termination,
    TurnRecord,
    episode_key,
    episode_totals,
)
from tasks.tool_schemas import DEFAULT_TOOL_SET
from tasks.tools import ToolBox, ToolResult

log = logging.getLogger("sandflow.episode")

# A live view (the CLI) gets these events: ("request", turn_index) before each model
# call, ("reply", TurnRecord) after it, ("tool", ToolCall) before each tool call,
# ("observation", Observation) after it, ("end", EpisodeRecord).
EventHook = Callable[[str, Any], None]


class CancelCheck(Protocol):
    """What the loop needs of a cancel token (engine.cancel.CancelToken has it)."""

    def is_set(self) -> bool: ...


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


class End(Exception):
    """Stop the episode with this termination reason (caught by whoever drives it)."""

    def __init__(self, reason: Termination, error: str | None = None) -> None:
        super().__init__(reason)
        self.reason: Termination = reason
        self.error = error


def now() -> datetime:
    return datetime.now(UTC)


def take_prefix(episode: Episode, prefix: EpisodePrefix) -> None:
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


def prepare(
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
        started_at=now(),
        prompt_messages=[dict(m) for m in messages],
        config=_public_config(model_cfg, limits, sandbox_cfg, mode, prompts.tool_set),
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


def _public_config(
    model_cfg: ModelConfig, limits: Limits, sandbox_cfg: SandboxConfig | None, mode: str, tool_set: str
) -> dict[str, Any]:
    cfg: dict[str, Any] = {"mode": mode, "model": model_cfg.public_dict(), "limits": limits.model_dump()}
    if mode == "sandbox" and tool_set != DEFAULT_TOOL_SET:  # what `tools_of` reads back
        cfg["tools"] = tool_set
    if sandbox_cfg is not None and mode == "sandbox":
        sb = sandbox_cfg.model_dump(mode="json")
        sb["env"] = sorted(sb.get("env", {}))  # names only: values may be secrets
        if sb.get("docker_host"):
            sb["docker_host"] = shown_address(sb["docker_host"])
        cfg["sandbox"] = sb
    return cfg


class Episode:
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
                raise End("interrupted", f"cancelled: {reason}")
            if kind == "request":  # a spent budget stops at the turn boundary: the paid
                raise End("budget_exhausted", reason)  # reply's tools run and it is recorded
        if self._on_event is not None:
            self._on_event(kind, payload)

    def watch_egress(self, sandbox: Sandbox) -> None:
        """Record the sandbox's requests through the egress proxy with the turns from now on
        (each in the turn during which it ended); a no-op for sandboxes without one."""
        if getattr(sandbox, "egress", None) is not None and callable(
            getattr(sandbox, "egress_settle", None)
        ):
            self._egress_box, self._egress_since = sandbox, time.time()

    def take_egress(self) -> list[EgressRequest]:
        if self._egress_box is None:
            return []
        self._egress_box.egress_settle()  # what ended before now is in the log: no request
        until = time.time()  # is left to the next turn, or lost after the last one
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

    def time_left(self) -> float | None:
        """The seconds left on the wall clock (None: no wall clock); End when none are."""
        left = self.remaining()
        if left is not None and left <= 0:
            raise End("wall_clock", f"episode wall clock of {self.limits.wall_clock_s:g}s reached")
        return left

    def check_limits(self) -> None:
        """End the episode now if the next model call could not be made: the wall clock
        ran out, or the context budget is used up (known when the last reply had usage)."""
        self.time_left()
        self.next_max_tokens()

    # -- the model call ----------------------------------------------------------
    def ask(self, tools: list[dict] | None) -> ModelReply:
        """One model call within the limits; context errors shrink max_tokens first."""
        for _ in range(MAX_CONTEXT_SHRINKS + 1):
            left = self.time_left()
            max_tokens = self.next_max_tokens()
            t_call = time.monotonic()
            try:
                reply = self.client.complete(self.messages, tools, max_tokens, timeout_s=left)
                reply.max_tokens_used = max_tokens
            except ContextLengthError as exc:
                self.max_tokens = self._shrunk(max_tokens, exc)
                continue
            except ModelError as exc:
                raise End("model_error", self._waited(t_call, str(exc))) from None
            if (left := self.remaining()) is not None and left <= 0:
                raise End("model_error", self._waited(t_call, "the reply came only then")) from None
            return reply
        raise End("context_exhausted", "the request still does not fit after shrinking max_tokens")

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
        """max_tokens for the next call within the context budget; End when it is used up."""
        max_tokens = self.max_tokens
        budget = self.limits.context_tokens
        if budget is not None and self.last_total_tokens is not None:
            max_tokens = min(max_tokens, budget - self.last_total_tokens)
            if max_tokens < self.model_cfg.min_max_tokens:
                raise End(
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
            raise End("context_exhausted", f"the model's context is full: {exc}")
        return new

    def turn_record(self, index: int, started: datetime, reply: ModelReply) -> TurnRecord:
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

    def record_turn(self, turn: TurnRecord) -> None:
        turn.egress = self.take_egress()
        self.turns.append(turn)
        self.recorder.record_turn(turn)

    # -- the tools and the answer -------------------------------------------------
    def call_tool(self, toolbox: ToolBox, call: Any, turn: TurnRecord) -> ToolResult:
        """Run one tool call within the time left; a limit or a broken sandbox records
        `turn` as it stands and ends the episode (End)."""
        try:
            left = self.time_left()
        except End:
            self.record_turn(turn)
            raise
        timeout = self.limits.exec_timeout_s or toolbox.sandbox.config.limits.exec_timeout_s
        if left is not None:
            timeout = max(1.0, min(timeout, left))
        try:
            return toolbox.call(call, timeout)
        except SandboxError as exc:
            if type(exc).__name__ == "SandboxExpired":  # the sandbox's own lifetime: a time limit
                self.record_turn(turn)
                raise End("wall_clock", f"the sandbox's lifetime ran out: {exc}") from None
            turn.error = f"sandbox error in {call.name}: {exc}"
            self.record_turn(turn)
            raise End("sandbox_error", turn.error) from None
        except Exception as exc:  # the engine's own errors (docker/requests): infrastructure
            turn.error = f"sandbox failure in {call.name}: {type(exc).__name__}: {exc}"
            self.record_turn(turn)
            raise End("sandbox_error", turn.error) from None

    def collect(self, sandbox: Sandbox, output_dir: Path | str | None) -> None:
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

    # -- the end -------------------------------------------------------------------
    def end(self, end: End, sandbox: Sandbox | None) -> None:
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
        r.ended_at = now()
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
