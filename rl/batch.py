"""One rollout batch: tasks x n samples against the trainer's endpoint, bounded, cancellable.

The episodes are the agent loop's own (tasks.loop.run_episode), recorded in the
warehouse like any run (one warehouse run per batch), each tagged with the training
run, step and policy version. A finished episode becomes a `trajectory` event at once;
when the last sample of a task is in, a `group` event carries its GRPO/RLOO advantages.

Infrastructure failures (the sandbox or the endpoint broke) are retried with backoff
(tenacity; each attempt re-records the same episode key, latest wins); after the last
attempt the trajectory has status "failed" and no reward: never a zero reward.

Cancelling (the trainer disconnected) stops everything of the batch at once: episodes
not started never start; running ones stop at their next step; their sandboxes are
removed now (an in-flight command is cut, not awaited) and their in-flight model calls
are abandoned (the batch's HTTP client is closed); each is recorded as `interrupted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_random_exponential

from datasets_prep.task import Task
from rl.groups import Group
from rl.recording import RolloutRecorder, RolloutTags
from rl.reward import RewardError, reward_of
from rl.rows import RowError, task_from_row
from rl.tokens import assemble
from rl.toolcalls import FORMATS, TextReply, parse_text_tool_calls
from sandbox.base import SandboxConfig
from tasks.loop import EpisodeResult, Limits, run_episode
from tasks.model import DEFAULT_RETRY_WINDOW_S, ModelClient, ModelConfig, ModelReply
from tasks.records import EpisodeRecord, Recorder, episode_key
from warehouse.schema import check_run_id

RETRYABLE = frozenset({"model_error", "sandbox_error"})
MAX_EPISODES_PER_BATCH = 100_000


class Endpoint(BaseModel):
    """The trainer's OpenAI-compatible server (vLLM, SGLang) serving the current policy."""

    base_url: str = Field(..., min_length=1, max_length=2000)
    model: str = Field(..., min_length=1, max_length=500)
    api_key: SecretStr | None = Field(None, exclude=True, repr=False)
    request_timeout_s: float = Field(600.0, gt=0)
    max_retries: int | None = Field(
        None, ge=0, le=1000, description="None: retries bounded by retry_window_s only"
    )
    retry_window_s: float = Field(
        DEFAULT_RETRY_WINDOW_S, ge=0, le=3600, description="how long one call's retries go on"
    )


class Sampling(BaseModel):
    temperature: float = Field(1.0, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int = Field(2048, ge=1)
    logprobs: bool = True
    return_token_ids: bool = True
    extra: dict[str, Any] = Field(
        default_factory=dict, description="passed as is (top_k, min_p...)"
    )


class RolloutRequest(BaseModel):
    """POST /v1/rollouts: what the trainer asks for (docs/rl.md has an example)."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[dict[str, Any]] = Field(..., min_length=1)
    n: int = Field(8, ge=1, le=4096, description="samples per task")
    endpoint: Endpoint
    sampling: Sampling = Field(default_factory=Sampling)
    training_run: str | None = Field(None, max_length=200)
    step: int | None = Field(None, ge=0)
    policy_version: str | None = Field(None, max_length=200)
    run_id: str | None = Field(
        None, description="warehouse run (default <training_run>-step<step>)"
    )
    limits: Limits | None = None
    tool_call_format: str = Field("auto", description="how tool calls are read from raw text")
    max_concurrency: int | None = Field(None, ge=1, description="at most the server's own bound")
    episode_attempts: int = Field(3, ge=1, le=10, description="tries per episode on infra failure")

    @field_validator("tool_call_format")
    @classmethod
    def _fmt(cls, v: str) -> str:
        if v not in FORMATS:
            raise ValueError(f"tool_call_format {v!r}: use one of {', '.join(FORMATS)}")
        return v

    def tags(self) -> RolloutTags:
        return RolloutTags(
            training_run=self.training_run, step=self.step, policy_version=self.policy_version
        )

    def resolved_run_id(self) -> str:
        if self.run_id:
            return check_run_id(self.run_id)
        base = re.sub(r"[^A-Za-z0-9._-]", "-", self.training_run or "rl").lstrip("._-") or "rl"
        suffix = f"-step{self.step}" if self.step is not None else f"-{int(time.time())}"
        return check_run_id(f"{base[: 128 - len(suffix)]}{suffix}")


class TextToolClient(ModelClient):
    """A ModelClient that reads tool calls from the reply's text when the server's tool
    parser is off (token-in-token-out setups); the history keeps the text as generated."""

    def __init__(self, cfg: ModelConfig, fmt: str) -> None:
        super().__init__(cfg)
        self.fmt = fmt
        self._calls = 0
        self._lock = threading.Lock()

    def complete(self, *args: Any, **kwargs: Any) -> ModelReply:
        reply = super().complete(*args, **kwargs)
        if reply.tool_calls or not reply.content or self.fmt == "none":
            return reply
        with self._lock:
            self._calls += 1
            prefix = f"call_{self._calls}_"
        calls = parse_text_tool_calls(reply.content, self.fmt, prefix)  # type: ignore[arg-type]
        if not calls:
            return reply
        return TextReply(**{**reply.__dict__, "tool_calls": calls})


class Batch:
    """One request's episodes; `events()` yields the NDJSON events as they happen."""

    def __init__(
        self,
        request: RolloutRequest,
        *,
        recorder: Recorder,
        executor: Executor,
        slots: asyncio.Semaphore,
        sandbox: SandboxConfig | None,
        default_limits: Limits,
        warehouse: Any | None = None,
        prompt_dir: str | None = None,
    ) -> None:
        self.request = request
        self.run_id = request.resolved_run_id()
        self.tasks: list[Task] = []
        for i, row in enumerate(request.tasks):
            self.tasks.append(task_from_row(row, where=f"tasks[{i}]"))
        self.total = len(self.tasks) * request.n
        if self.total > MAX_EPISODES_PER_BATCH:
            raise RowError(
                f"{len(self.tasks)} tasks x n={request.n} = {self.total} episodes; at most "
                f"{MAX_EPISODES_PER_BATCH} per request"
            )
        self.limits = request.limits or default_limits
        self.sandbox = sandbox or SandboxConfig()
        self.executor, self.slots = executor, slots
        self.own_slots = asyncio.Semaphore(request.max_concurrency or self.total)
        self.warehouse, self.prompt_dir = warehouse, prompt_dir
        self.cancel_event = threading.Event()
        self.episode_ids: set[str] = set()
        self.recorder = RolloutRecorder(recorder, request.tags(), self._cancelled)
        self.model_cfg = ModelConfig(
            model=request.endpoint.model,
            base_url=request.endpoint.base_url,
            api_key=request.endpoint.api_key,
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p,
            max_tokens=request.sampling.max_tokens,
            logprobs=request.sampling.logprobs,
            return_token_ids=request.sampling.return_token_ids,
            request_timeout_s=request.endpoint.request_timeout_s,
            max_retries=request.endpoint.max_retries,
            retry_window_s=request.endpoint.retry_window_s,
            extra_body=request.sampling.extra,
        )
        self.client = TextToolClient(self.model_cfg, request.tool_call_format)
        self.active = 0  # episodes holding a sandbox or a model call right now
        self.peak_active = 0
        self.counts = {"ok": 0, "failed": 0, "cancelled": 0}
        self.t0 = time.monotonic()
        self._samples = self._plan()

    # -- plan -------------------------------------------------------------------------
    def _plan(self) -> list[tuple[Task, int]]:
        """(task, sample_index) pairs; a task listed twice continues its numbering."""
        seen: dict[str, int] = {}
        out = []
        for task in self.tasks:
            start = seen.get(task.id, 0)
            for k in range(self.request.n):
                out.append((task, start + k))
            seen[task.id] = start + self.request.n
        for task, index in out:
            self.episode_ids.add(episode_key(self.run_id, task.id, "sandbox", index))
        return out

    def _cancelled(self, episode_id: str) -> bool:
        return self.cancel_event.is_set()

    # -- cancel -----------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the batch now; safe to call from any thread, more than once."""
        if self.cancel_event.is_set():
            return
        self.cancel_event.set()
        from sandbox import registry

        for box in registry.live():
            cfg = getattr(box, "config", None)
            if cfg is not None and cfg.run_id == self.run_id and cfg.episode_id in self.episode_ids:
                # As a Ctrl+C does: the loop then records the episode as interrupted.
                with contextlib.suppress(Exception):
                    box.killed_by_signal = signal.SIGTERM
                with contextlib.suppress(Exception):
                    box.kill()
        with contextlib.suppress(Exception):
            self.client.close()

    def _pause(self, seconds: float) -> None:
        """Backoff between attempts that a cancel cuts short."""
        self.cancel_event.wait(seconds)

    def _stop_if_cancelled(self, kind: str, payload: Any) -> None:
        if kind != "end" and self.cancel_event.is_set():
            raise KeyboardInterrupt  # run_episode records "interrupted" and closes the sandbox

    # -- one episode (a worker thread) --------------------------------------------------
    def _run(self, task: Task, index: int) -> EpisodeResult | None:
        if self.cancel_event.is_set():
            return None

        def attempt() -> EpisodeResult:
            return run_episode(
                task,
                self.model_cfg,
                self.sandbox,
                self.recorder,
                sample_index=index,
                run_id=self.run_id,
                limits=self.limits,
                client=self.client,
                prompt_dir=self.prompt_dir,
                on_event=self._stop_if_cancelled,
            )

        retrying = Retrying(
            retry=retry_if_result(
                lambda r: r.record.termination in RETRYABLE and not self.cancel_event.is_set()
            ),
            stop=stop_after_attempt(self.request.episode_attempts),
            wait=wait_random_exponential(multiplier=0.5, max=10.0),
            sleep=self._pause,
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        try:
            result: EpisodeResult | None = retrying(attempt)
        except KeyboardInterrupt:
            return None
        if result is not None:
            result.record.config["attempts"] = retrying.statistics.get("attempt_number", 1)
        return result

    def _run_event(self, task: Task, index: int) -> dict[str, Any]:
        """A worker thread's job: the episode, then its event (the reward is computed here,
        off the event loop: verifiers are CPU work)."""
        return self.trajectory(task, index, self._run(task, index))

    def trajectory(self, task: Task, index: int, result: EpisodeResult | None) -> dict[str, Any]:
        """The `trajectory` event of one finished (or cancelled) episode."""
        ep_id = episode_key(self.run_id, task.id, "sandbox", index)
        base: dict[str, Any] = {
            "type": "trajectory",
            "run_id": self.run_id,
            "episode_id": ep_id,
            "task_id": task.id,
            "sample_index": index,
            "training_run": self.request.training_run,
            "step": self.request.step,
            "policy_version": self.request.policy_version,
        }
        if (
            result is None
            or self.cancel_event.is_set()
            and result.record.termination == "interrupted"
        ):
            return base | {"status": "cancelled", "termination": "interrupted", "reward": None}
        rec: EpisodeRecord = result.record
        tokens = assemble(result.turns)
        out = base | {
            "status": "ok",
            "termination": rec.termination,
            "error": rec.error,
            "answer": rec.answer,
            "reward": None,
            "reward_reason": None,
            "verifier": None,
            "attempts": rec.config.get("attempts", 1),
            "num_turns": rec.num_turns,
            "messages": result.messages,
            "message_loss_mask": [
                1 if m.get("role") == "assistant" else 0 for m in result.messages
            ],
            "token_ids_status": tokens.status,
            "prompt_ids": tokens.prompt_ids,
            "response_ids": tokens.response_ids,
            "response_mask": tokens.response_mask,
            "response_logprobs": tokens.response_logprobs,
            "overlong": rec.termination == "context_exhausted"
            or any(t.finish_reason == "length" for t in result.turns),
            "usage": {
                "prompt_tokens": rec.prompt_tokens,
                "completion_tokens": rec.completion_tokens,
            },
            "wall_s": round(rec.wall_s, 4),
        }
        if rec.is_infra_failure:
            return out | {"status": "failed"}
        try:
            r = reward_of(task, rec.answer)
        except RewardError as exc:
            return out | {"status": "failed", "error": str(exc)}
        return out | {"reward": r.score, "reward_reason": r.reason, "verifier": r.verifier}

    # -- the stream ---------------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """`start`, then a `trajectory` per episode as it ends (with `group` events once a
        task's samples are all in), then `done`. Cancelled when the consumer goes away."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[Task, dict[str, Any]]] = asyncio.Queue()

        async def one(task: Task, index: int) -> None:
            event: dict[str, Any] | None = None
            try:
                async with self.slots, self.own_slots:
                    if self.cancel_event.is_set():
                        return
                    self.active += 1
                    self.peak_active = max(self.peak_active, self.active)
                    try:
                        event = await loop.run_in_executor(
                            self.executor, self._run_event, task, index
                        )
                    finally:
                        self.active -= 1
            finally:
                queue.put_nowait((task, event or self.trajectory(task, index, None)))

        groups = {
            t.id: Group(t.id, sum(1 for s in self._samples if s[0].id == t.id)) for t in self.tasks
        }
        yield {
            "type": "start",
            "run_id": self.run_id,
            "episodes": self.total,
            "tasks": len(groups),
            "n": self.request.n,
        }
        workers = [asyncio.ensure_future(one(t, i)) for t, i in self._samples]
        scores: list[dict[str, Any]] = []
        try:
            for _ in range(self.total):
                task, event = await queue.get()
                self.counts[event["status"]] += 1
                if event["status"] == "ok" and event.get("reward") is not None:
                    scores.append(_score_row(event, task))
                yield event
                if groups[task.id].add(event["episode_id"], event.get("reward")):
                    yield {"type": "group", "run_id": self.run_id, **groups[task.id].advantages()}
            yield self.summary()
        finally:
            if any(not w.done() for w in workers):
                self.cancel()
                for w in workers:
                    w.cancel()
            self.client.close()
            if scores and self.warehouse is not None:
                with contextlib.suppress(Exception):  # the trajectories are already out
                    self.warehouse.write_scores(scores)

    def summary(self) -> dict[str, Any]:
        return {
            "type": "done",
            "run_id": self.run_id,
            "episodes": self.total,
            **self.counts,
            "peak_concurrent": self.peak_active,
            "wall_s": round(time.monotonic() - self.t0, 3),
        }


def _score_row(event: dict[str, Any], task: Task) -> dict[str, Any]:
    return {
        "run_id": event["run_id"],
        "episode_id": event["episode_id"],
        "verifier": event["verifier"],
        "score": event["reward"],
        "passed": event["reward"] >= 1.0,
        "reason": event["reward_reason"],
        "answer": event["answer"],
        "ground_truth": task.ground_truth,
    }
