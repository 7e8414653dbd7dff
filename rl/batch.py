"""One rollout batch: tasks x n samples against the trainer's endpoint, bounded, cancellable.

The episodes are the agent loop's own (tasks.loop.run_episode), recorded in the
warehouse like any run (one warehouse run per batch), each tagged with the training
run, step and policy version. A finished episode becomes a `trajectory` event at once;
when the last sample of a task is in, a `group` event carries its GRPO/RLOO advantages.

The batch runs through the engine (engine/): its plan (sample numbering), the one
retry policy for infrastructure failures (the sandbox or the endpoint broke; each
attempt re-records the same episode key, latest wins; after the last attempt the
trajectory has status "failed" and no reward: never a zero reward), the in-process
executor on the server's shared thread pool, and a cancel token.

Cancelling (the trainer disconnected) sets the batch's token: episodes not started
never start; running ones stop at their next step (the agent loop checks the token);
a callback on the token removes their sandboxes now (an in-flight command is cut, not
awaited) and abandons their in-flight model calls (the batch's HTTP client is closed);
each is recorded as `interrupted`.

A batch may have a budget (`budget`: max_cost_usd / max_run_tokens, or the server's
default; issue #28, engine.budget): the batch is one warehouse run, so what it spent is
its recorded turns (priced with the server's price table) plus its running episodes'
replies. Reached: no episode starts, running ones stop at their next turn boundary
(their sandboxes are not cut: the paid reply's tools run and are recorded) as
`budget_exhausted`; the trainer gets each as a `trajectory` with status "cancelled",
termination "budget_exhausted" and no reward (never a zero reward), and `done` carries
`stopped: "budget_exhausted"` and `budget`. The run's status is `budget_exhausted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from analysis.token_ids import assemble
from datasets_prep.rows import RowError, task_from_row
from datasets_prep.task import Task
from engine import budget as budgets
from engine.cancel import CancelToken
from engine.executors import ThreadExecutor, Work
from engine.plan import EpisodeSpec, plan
from engine.retry import EpisodeCancelled, InfraFailure, RetryPolicy, is_retryable
from rl.groups import Group
from rl.recording import RolloutRecorder, RolloutTags
from rl.reward import RewardError, reward_of
from rl.slots import Slots
from rl.toolcalls import FORMATS, TextReply, parse_text_tool_calls
from rl.tree import Branch, BranchSpec, branch_points, grow
from sandbox.base import SandboxConfig
from tasks.loop import EpisodeResult, Limits, SteppedEpisode, run_episode
from tasks.model import DEFAULT_RETRY_WINDOW_S, ModelClient, ModelConfig, ModelReply
from tasks.records import EpisodeRecord, Recorder, episode_key
from tasks.spec import RunSpec
from warehouse.schema import check_run_id

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


class Budget(BaseModel):
    """A batch's budget (docs/cost.md): the batch's run stops once its turns cost this much
    (priced with the server's table: `sandflow rl serve --prices`) or used this many tokens."""

    model_config = ConfigDict(extra="forbid")

    max_cost_usd: float | None = Field(None, ge=0, allow_inf_nan=False)
    max_run_tokens: int | None = Field(None, ge=1)


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
    branching: BranchSpec | None = Field(
        None, description="tree rollouts: each of the n samples branches (rl.tree)"
    )
    budget: Budget | None = Field(None, description="None: the server's default budget (if any)")

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
        executor: ThreadPoolExecutor,
        sandbox: SandboxConfig | None,
        server_slots: threading.Semaphore | None = None,
        default_limits: Limits,
        warehouse: Any | None = None,
        prompt_dir: str | None = None,
        prices: dict[str, Any] | None = None,
        default_budget: Budget | None = None,
    ) -> None:
        self.request = request
        self.run_id = request.resolved_run_id()
        self.tasks: list[Task] = []
        for i, row in enumerate(request.tasks):
            self.tasks.append(task_from_row(row, where=f"tasks[{i}]"))
        self.total = len(self.tasks) * request.n
        self.branching = request.branching
        leaves = self.branching.max_leaves if self.branching else 1
        if self.total * leaves > MAX_EPISODES_PER_BATCH:
            raise RowError(
                f"{len(self.tasks)} tasks x n={request.n} x {leaves} leaves at most = "
                f"{self.total * leaves} episodes; at most {MAX_EPISODES_PER_BATCH} per request"
            )
        self.limits = request.limits or default_limits
        self.sandbox = sandbox or SandboxConfig()
        # The server's pool is shared by every batch (its size is the server's bound);
        # this batch's own bound is the request's max_concurrency.
        self.executor = ThreadExecutor(
            max_workers=1, pool=executor, max_in_flight=request.max_concurrency or self.total
        )
        self.policy = RetryPolicy(
            retries=request.episode_attempts - 1, delay_s=0.5, max_delay_s=10.0
        )
        self.warehouse, self.prompt_dir = warehouse, prompt_dir
        self.cancel_event = CancelToken()
        self.cancel_event.on_cancel(self._stop_everything)
        self.episodes: list[EpisodeSpec] = plan(self.tasks, self.run_id, "sandbox", request.n)
        self.episode_ids: set[str] = {ep.key for ep in self.episodes}
        self.recorder = RolloutRecorder(recorder, request.tags(), self._cancelled)
        # Endpoint and Sampling name their fields as ModelConfig does (the key is left out
        # of dumps, `extra` is the request body's extras)
        self.model_cfg = ModelConfig(
            **request.endpoint.model_dump(),
            api_key=request.endpoint.api_key,
            **request.sampling.model_dump(exclude={"extra"}),
            extra_body=request.sampling.extra,
        )
        self.client = TextToolClient(self.model_cfg, request.tool_call_format)
        # the budget (engine.budget) counts the batch's run in the warehouse: the RunSpec it reads
        b = request.budget or default_budget or Budget()
        self.budget_spec = RunSpec(
            run_id=self.run_id,
            model=request.endpoint.model,
            base_url=request.endpoint.base_url,
            warehouse=str(warehouse.root) if warehouse is not None else None,
            prices=dict(prices or {}),
            max_cost_usd=b.max_cost_usd,
            max_run_tokens=b.max_run_tokens,
        )
        budgets.check_priced(self.budget_spec)  # RunConfigError (a ValueError): 422, before any work
        self.budget = (
            budgets.RunBudget(self.budget_spec, self.cancel_event)
            if budgets.has_budget(self.budget_spec)
            else None
        )
        # running episodes (a sandbox driven, one model call at a time): the server's bound
        # over every batch and this batch's own; a tree's siblings take theirs (rl.slots)
        self.slots = Slots(server_slots, request.max_concurrency)
        self._active_lock = threading.Lock()
        self._attempts: dict[str, int] = {}
        self.done = False  # the stream sent `done`
        # the run's lock while the batch writes its run (rl.server: taken before the run is
        # recorded `running`, released after its end is recorded)
        self.run_lock = contextlib.ExitStack()
        self._finish_claimed = False
        self.counts = {"ok": 0, "failed": 0, "cancelled": 0}
        self.t0 = time.monotonic()

    @property
    def active(self) -> int:
        """Episodes of this batch running right now."""
        return self.slots.active

    @property
    def peak_active(self) -> int:
        return self.slots.peak

    def claim_finish(self) -> bool:
        """True once: the caller finishes the batch's run record."""
        with self._active_lock:
            claimed, self._finish_claimed = self._finish_claimed, True
        return not claimed

    def _cancelled(self, episode_id: str) -> bool:
        """The trainer (or the server) stopped the batch; a spent budget is not that: its
        episodes keep their `budget_exhausted` ending (rl.recording)."""
        return self.cancel_event.is_set() and not self.budget_spent

    # -- cancel -----------------------------------------------------------------------
    def cancel(self, reason: str = "the trainer disconnected") -> None:
        """Stop the batch now; safe to call from any thread, more than once."""
        self.cancel_event.cancel(reason)

    @property
    def budget_spent(self) -> bool:
        """The batch's budget stopped it (not the trainer, not the server)."""
        return self.cancel_event.is_set() and self.cancel_event.termination == budgets.TERMINATION

    def _stop_everything(self, reason: str) -> None:
        """The token's callback: remove the batch's live sandboxes (the loop, seeing the
        token, records their episodes as interrupted) and abandon its model calls. Not when
        the budget set it: running episodes end at their next turn boundary by themselves
        (tasks.loop), their paid replies' tools run."""
        if self.budget_spent:
            return
        from sandbox import registry

        for box in registry.live():
            cfg = getattr(box, "config", None)
            if cfg is not None and cfg.run_id == self.run_id and cfg.episode_id in self.episode_ids:
                with contextlib.suppress(Exception):
                    box.kill()
        with contextlib.suppress(Exception):
            self.client.close()

    # -- one attempt of one episode (a worker thread) ----------------------------------
    def _attempt(self, ep: EpisodeSpec) -> tuple[EpisodeSpec, Any]:
        """The engine's job: one attempt; InfraFailure (carrying the result) when it is
        worth another, EpisodeCancelled when the batch was cancelled."""
        if self.budget is not None:  # what the warehouse holds: earlier attempts, a resumed batch
            self.budget.refresh_if_due()
            if self.cancel_event.is_set():
                raise EpisodeCancelled(f"episode {ep.key} not started: {self.cancel_event.reason}")
        if self.branching is not None:
            return self._tree(ep, self.branching)
        with self._holding(ep.key):
            result = run_episode(
                ep.task,
                sandbox_cfg=self.sandbox,
                recorder=self.recorder,
                **self._episode_args(ep),
                cancel=self.cancel_event,
                on_event=self.budget.hook(ep.key) if self.budget is not None else None,
            )
        result.record.config["attempts"] = self._attempt_number(ep.key)
        stopped = result.record.termination in ("interrupted", budgets.TERMINATION)
        if stopped and self.cancel_event.is_set():
            raise EpisodeCancelled(f"episode {ep.key} stopped: {self.cancel_event.reason}")
        if is_retryable(result.record.termination):
            raise InfraFailure(f"{ep.label}: {result.record.termination}", (ep, result), self.run_id)
        return ep, result

    def _episode_args(self, ep: EpisodeSpec) -> dict[str, Any]:
        """What every episode of the batch runs with, a plain one and a tree's root alike."""
        return dict(model_cfg=self.model_cfg, sample_index=ep.sample_index, run_id=self.run_id,
                    limits=self.limits, client=self.client, prompt_dir=self.prompt_dir)

    @contextlib.contextmanager
    def _holding(self, key: str) -> Iterator[None]:
        """An episode runs holding a slot (rl.slots: waited for; EpisodeCancelled if the
        batch is cancelled first); what it spent is counted from the warehouse once it
        ends (the budget)."""
        self.slots.take(self.cancel_event, f"episode {key}")
        try:
            yield
        finally:
            self.slots.give()
            if self.budget is not None:
                self.budget.episode_ended(key)

    def _attempt_number(self, key: str) -> int:
        with self._active_lock:
            self._attempts[key] = attempts = self._attempts.get(key, 0) + 1
        return attempts

    def _tree(self, ep: EpisodeSpec, spec: BranchSpec) -> tuple[EpisodeSpec, list[Branch]]:
        """One attempt of a tree rooted at sample `ep` (rl.tree.grow). Its branches take
        sample indices after the batch's roots, n + root x (max_leaves - 1) + j: unique
        and the same on a retry. Retried as a whole only when the root failed before it
        branched (infrastructure); a branch that fails later is a failed leaf."""
        base = self.request.n + ep.sample_index * (spec.max_leaves - 1)
        counter = iter(range(base, base + spec.max_leaves - 1))

        def next_index() -> int:  # a branch's sandbox is labelled with its own episode
            index = next(counter)
            self.episode_ids.add(episode_key(self.run_id, ep.task.id, "sandbox", index))
            return index

        # the root's slot; grow gives it back, and each sibling running at once takes its own
        self.slots.take(self.cancel_event, f"tree {ep.key}")
        try:
            root = SteppedEpisode(ep.task, self.sandbox, self.recorder, **self._episode_args(ep))
            root.cancel = self.cancel_event
            root.start()
        except BaseException:
            self.slots.give()
            raise
        budget = self.budget

        def on_turn(e: SteppedEpisode, before: int) -> None:  # spend counted as turns land
            if budget is not None:
                hook = budget.hook(e.record.episode_id)
                for turn in e.turns[before:]:
                    hook("reply", turn)

        def on_end(e: SteppedEpisode) -> None:
            if budget is not None:
                budget.episode_ended(e.record.episode_id)

        branches = grow(root, spec, next_index, slots=self.slots, on_turn=on_turn, on_end=on_end)
        attempts = self._attempt_number(ep.key)
        for b in branches:
            b.episode.record.config["attempts"] = attempts
        term = root.record.termination
        if self.cancel_event.is_set():  # every leaf reported: finished ones with their reward
            return ep, branches
        if len(branches) == 1 and is_retryable(term):
            raise InfraFailure(f"{ep.label}: {term}", (ep, branches), self.run_id)
        return ep, branches

    def _events_of(self, ep: EpisodeSpec, res: Any) -> list[dict[str, Any]]:
        """The events of what the executor handed back: one trajectory, or a tree's
        trajectories (each with its lineage) then its branch points."""
        if isinstance(res, InfraFailure) and isinstance(res.outcome, tuple):
            res = res.outcome
        if not (isinstance(res, tuple) and isinstance(res[1], list)):
            return [self._event_of(ep, res)]
        branches: list[Branch] = res[1]
        root = branches[0].episode.record.episode_id if branches else None
        for b in branches:
            if b.parent is None:
                root = b.episode.record.episode_id
        events = []
        for b in branches:
            e = b.episode
            result = EpisodeResult(e.record, e.turns, e.messages)
            event = self.trajectory(ep.task, e.record.sample_index, result)
            event.update(
                tree_root=root,
                parent_episode_id=b.parent,
                branch_turn=b.branch_turn,
                branch_kind="fork" if b.parent else None,
                branch_path=[list(p) for p in b.path],
            )
            if b.fork_error:
                event["fork_error"] = b.fork_error
            events.append(event)
        rewards = {
            ev["episode_id"]: ev.get("reward") for ev in events if ev.get("status") == "ok"
        }
        for point in branch_points(branches, rewards):
            events.append(
                {
                    "type": "branch_point",
                    "run_id": self.run_id,
                    "task_id": ep.task.id,
                    "tree_root": root,
                    **point,
                }
            )
        return events

    def _event_of(self, ep: EpisodeSpec, res: Any) -> dict[str, Any]:
        """The trajectory event of what the executor handed back (the reward is computed
        here, off the event loop: verifiers are CPU work)."""
        if isinstance(res, InfraFailure) and isinstance(res.outcome, tuple):
            res = res.outcome  # the last attempt: a failed trajectory with its record
        if isinstance(res, tuple):
            return self.trajectory(ep.task, ep.sample_index, res[1])
        return self.trajectory(ep.task, ep.sample_index, None)  # cancelled, or a bug

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
        if self.budget_spent and (
            result is None or result.record.termination in ("interrupted", budgets.TERMINATION)
        ):
            # never started, or stopped at a turn boundary: no sample, never a zero reward
            return base | {"status": "cancelled", "termination": budgets.TERMINATION,
                           "reward": None, "reason": self.cancel_event.reason}  # fmt: skip
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
    def _fan_out(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        """The engine's fan-out (a thread of its own): every episode's event onto `queue`
        as it ends, then None."""
        try:
            work = Work(self._attempt, self.episodes, (), self.policy, self.cancel_event)
            for ep, res in self.executor.map(work):
                events = self._events_of(ep, res)
                loop.call_soon_threadsafe(queue.put_nowait, (ep.task, events))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """`start`, then a `trajectory` per episode as it ends (with `group` events once a
        task's samples are all in), then `done`. Cancelled when the consumer goes away."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        groups = {
            t.id: Group(t.id, sum(1 for ep in self.episodes if ep.task.id == t.id)) for t in self.tasks
        }
        yield {
            "type": "start",
            "run_id": self.run_id,
            "episodes": self.total,
            "tasks": len(groups),
            "n": self.request.n,
            "branching": self.branching.model_dump() if self.branching else None,
        }
        if self.branching is not None:  # a tree holds `width` sandboxes at a branch point
            from sandbox import prewarm

            at_once = min(self.total, self.request.max_concurrency or self.total)
            prewarm(self.sandbox, at_once * self.branching.width)  # no-op unless pooled
        fan_out = threading.Thread(
            target=self._fan_out, args=(loop, queue), name=f"rollout-{self.run_id}", daemon=True
        )
        fan_out.start()
        scores: list[dict[str, Any]] = []
        complete = False
        try:
            while (item := await queue.get()) is not None:
                task, events = item
                group = groups[task.id]
                trajectories = [e for e in events if e["type"] == "trajectory"]
                group.expected += len(trajectories) - 1  # a tree: one sample, several leaves
                for event in events:
                    yield event
                for event in trajectories:
                    self.counts[event["status"]] += 1
                    if event["status"] == "ok" and event.get("reward") is not None:
                        scores.append(_score_row(event, task))
                    if group.add(event["episode_id"], event.get("reward")):
                        yield {"type": "group", "run_id": self.run_id, **group.advantages()}
            complete = True
            self.done = True
            yield self.summary()
        finally:
            if not complete:
                self.cancel()
            self.client.close()
            if scores and self.warehouse is not None:
                with contextlib.suppress(Exception):  # the trajectories are already out
                    self.warehouse.write_scores(scores)

    def summary(self) -> dict[str, Any]:
        out = {
            "type": "done",
            "run_id": self.run_id,
            "episodes": sum(self.counts.values()) if self.branching else self.total,
            **self.counts,
            "peak_concurrent": self.peak_active,
            "wall_s": round(time.monotonic() - self.t0, 3),
        }
        if self.budget is not None:
            # {max_cost_usd, max_run_tokens, spent_tokens, spent_usd, exhausted}
            out["budget"] = self.budget.summary()
        if self.budget_spent:
            out["stopped"] = budgets.TERMINATION
            out["reason"] = self.cancel_event.reason
        return out


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
