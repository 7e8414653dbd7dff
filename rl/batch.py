"""One rollout batch: tasks x n samples against the trainer's endpoint, bounded, cancellable.

The episodes are the agent loop's own (tasks.loop.run_episode), recorded in the
warehouse like any run (one warehouse run per batch), each tagged with the training
run, step and policy version. A finished episode becomes a `trajectory` event at once;
when the last sample of a task is in, a `group` event carries its GRPO/RLOO advantages.

The batch runs through the engine (engine/) as every run does: its plan (sample
numbering), and its run through `engine.run.open_run`, the piece `engine.run` uses too:
the run's lock and record (`begin`), the fan-out (RunHandle.fan_out: the in-process
executor on the server's shared thread pool, the one retry policy for infrastructure
failures, the batch's cancel token and budget), each episode handed back as it ends
(streamed at once), and the run's end by the engine's rules (`end`: `finished`, `failed`
when episodes failed after their retries, `interrupted`, `budget_exhausted`). An
infrastructure failure re-runs the episode (the sandbox or the endpoint broke; each
attempt re-records the same episode key, latest wins; after the last attempt the
trajectory has status "failed" and no reward: never a zero reward).

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
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from analysis.trajectory import RewardError, reward, rollout_fields, score_row
from datasets_prep.rows import RowError, task_from_row
from datasets_prep.task import Task
from engine import budget as budgets
from engine import progress
from engine.cancel import CancelToken
from engine.executors import ThreadExecutor
from engine.plan import EpisodeSpec, plan
from engine.retry import EpisodeCancelled, InfraFailure, RetryPolicy, is_retryable
from engine.run import RunHandle, compact_after_run, open_run
from rl.groups import Group
from rl.recording import RolloutRecorder, RolloutTags
from rl.slots import Slots
from rl.toolcalls import FORMATS, TextReply, parse_text_tool_calls
from rl.tree import Branch, BranchSpec, branch_points, grow
from sandbox.base import SandboxConfig
from tasks.defaults import RL_REQUEST_TIMEOUT_S, RL_TEMPERATURE
from tasks.loop import EpisodeResult, Limits, SteppedEpisode, run_episode
from tasks.model import DEFAULT_RETRY_WINDOW_S, ModelClient, ModelConfig, ModelReply
from tasks.records import EpisodeRecord, Recorder, episode_key
from tasks.spec import Endpoint as RunEndpoint
from tasks.spec import Sampling as RunSampling
from tasks.spec import build_run_spec, model_config_of
from warehouse.schema import check_run_id

MAX_EPISODES_PER_BATCH = 100_000
# How long a batch's end waits for its fan-out to have stopped its episodes (each stops at
# its next step; their sandboxes are removed, their model calls abandoned, on a cancel).
END_WAIT_S = 60.0

log = logging.getLogger(__name__)


class Endpoint(RunEndpoint):
    """The trainer's OpenAI-compatible server (vLLM, SGLang) serving the current policy: a
    run's endpoint part (tasks.spec.Endpoint), with its own key and a longer wait."""

    # an unknown key is a 422 naming it: a misspelt `request_timeout_s` was silently dropped
    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(..., min_length=1, max_length=2000)
    model: str = Field(..., min_length=1, max_length=500)
    api_key: SecretStr | None = Field(None, exclude=True, repr=False)
    request_timeout_s: float = Field(
        RL_REQUEST_TIMEOUT_S, gt=0,
        description="600 s, not a run's 120: the trainer's server generates the whole batch at "
        "once (and pauses for weight syncs), so one call may queue for minutes (tasks/defaults.py)",
    )  # fmt: skip
    retry_window_s: float = Field(
        DEFAULT_RETRY_WINDOW_S, ge=0, le=3600, description="how long one call's retries go on"
    )


class Sampling(RunSampling):
    """A run's sampling part (tasks.spec.Sampling) with the defaults of on-policy rollouts:
    temperature 1.0 (the policy's own distribution; tasks/defaults.py RL_TEMPERATURE), and
    the logprobs and token ids a trainer needs. `extra` in the request's JSON."""

    # an unknown key is a 422 naming it (a misspelt `temperature` ran at 1.0); a server's
    # own sampling parameters (top_k, min_p...) go in `extra`
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    temperature: float = Field(RL_TEMPERATURE, ge=0)
    logprobs: bool = True
    return_token_ids: bool = True
    extra_body: dict[str, Any] = Field(
        default_factory=dict, alias="extra", description="passed as is (top_k, min_p...)"
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
        self.model_cfg = model_config_of(request.endpoint, request.sampling, request.endpoint.api_key)
        self.client = TextToolClient(self.model_cfg, request.tool_call_format)
        # the budget (engine.budget) counts the batch's run in the warehouse: the RunSpec it reads
        b = request.budget or default_budget or Budget()
        self.budget_spec = build_run_spec(
            run_id=self.run_id,
            model=request.endpoint.model,
            base_url=request.endpoint.base_url,
            warehouse=str(warehouse.root) if warehouse is not None else None,
            prices=prices,
            max_cost_usd=b.max_cost_usd,
            max_run_tokens=b.max_run_tokens,
        )
        budgets.check_priced(self.budget_spec)  # RunConfigError (a ValueError): 422, before any work
        # running episodes (a sandbox driven, one model call at a time): the server's bound
        # over every batch and this batch's own; a tree's siblings take theirs (rl.slots)
        self.slots = Slots(server_slots, request.max_concurrency)
        self._active_lock = threading.Lock()
        self._attempts: dict[str, int] = {}
        self._score_rows: dict[str, dict[str, Any]] = {}  # episode id -> its score row, until streamed
        self.done = False  # the stream sent `done`
        # the batch's run in the engine (engine.run.open_run: its lock, its record, its
        # fan-out, its end), from `begin` until `end`
        self.run: RunHandle | None = None
        self.run_lock = contextlib.ExitStack()
        self._ended = False
        self._fan_out_thread: threading.Thread | None = None
        self.counts = {"ok": 0, "failed": 0, "cancelled": 0}
        self.t0 = time.monotonic()

    @property
    def active(self) -> int:
        """Episodes of this batch running right now."""
        return self.slots.active

    @property
    def peak_active(self) -> int:
        return self.slots.peak

    @property
    def budget(self) -> budgets.RunBudget | None:
        """The batch's budget (engine.budget), started by the engine's fan-out."""
        return self.run.budget if self.run is not None else None

    # -- the batch's run: the engine's (engine.run.open_run) ------------------------------
    def begin(self) -> None:
        """Take the batch's run through the engine (engine.run.open_run): its lock, then
        its record `running` and the exact tasks it runs. Held until `end` has recorded how
        the batch ended: if the server dies first (kill -9, OOM), the kernel frees the lock
        and readers see the run `interrupted` (abandoned), never `running` forever.
        RunLockedError when another process (a second server, `sandflow flows run`) writes
        this run id. Blocking: the server calls it on a worker thread."""
        stack = contextlib.ExitStack()
        run = stack.enter_context(open_run(self.warehouse, self.run_id, self.cancel_event))
        try:
            run.record(model=self.request.endpoint.model, notes="rl rollout server batch",
                       config=self._run_config())  # fmt: skip
            if self.warehouse is not None:
                self.warehouse.keep_tasks(self.run_id, self.tasks, name="rl-batch")
        except BaseException:
            stack.close()
            raise
        self.run, self.run_lock = run, stack

    def _run_config(self) -> dict[str, Any]:
        """What the batch's run record says about how it ran (no secret)."""
        req = self.request
        return {
            "form": "server",
            "training_run": req.training_run,
            "step": req.step,
            "policy_version": req.policy_version,
            "n": req.n,
            "tasks": len(self.tasks),
            "sampling": req.sampling.model_dump(by_alias=True),
            "endpoint": req.endpoint.model_dump(),  # api_key excluded by the model
            "limits": self.limits.model_dump(),
            # what `run_cost` prices the batch's turns with (warehouse/cost.py), and its budget
            "model": {"model": req.endpoint.model, "base_url": req.endpoint.base_url},
            "prices": self.budget_spec.budget.prices,
            "max_cost_usd": self.budget_spec.budget.max_cost_usd,
            "max_run_tokens": self.budget_spec.budget.max_run_tokens,
        }

    def end(self, compact: bool = True) -> str | None:
        """The batch's run leaves `running` by the engine's rules (RunHandle.finish:
        `finished`, `failed` when episodes failed after their retries, `budget_exhausted`,
        or `interrupted` when the batch was cancelled or its fan-out did not end), is
        compacted when it ran to its end, then its lock is released. Once, whoever calls
        first (the stream's end, the server stopping); its fan-out's episodes have stopped
        first (waited for up to END_WAIT_S). The run's status; None without `begin`."""
        with self._active_lock:
            if self.run is None or self._ended:
                return None
            self._ended = True
        thread = self._fan_out_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(END_WAIT_S)
        status = None
        try:
            status = self.run.finish()
            root = self.run.root
            if compact and status in ("finished", "failed") and root is not None:
                compact_after_run(root, self.run_id)
        except Exception as exc:  # the rollouts were delivered; the bookkeeping can be redone
            log.warning("finishing warehouse run %s failed: %s", self.run_id, exc)
        finally:
            self.run_lock.close()
        return status

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
        budget = self.budget
        if budget is not None:  # what the warehouse holds: earlier attempts, a resumed batch
            budget.refresh_if_due()
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
                on_event=budget.hook(ep.key) if budget is not None else None,
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
            budget = self.budget
            if budget is not None:
                budget.episode_ended(key)

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
            # messages, loss_mask, token columns, overlong (analysis.trajectory): the
            # episode's own history, exactly what the policy saw
            **rollout_fields(rec, result.turns, result.messages),
            "usage": {
                "prompt_tokens": rec.prompt_tokens,
                "completion_tokens": rec.completion_tokens,
            },
            "wall_s": round(rec.wall_s, 4),
        }
        if rec.is_infra_failure:
            return out | {"status": "failed"}
        try:
            r = reward(task, rec.answer)
        except RewardError as exc:
            return out | {"status": "failed", "error": str(exc)}
        # the warehouse's score row (analysis.trajectory.score_row), written with the batch's
        wid = self.warehouse.write_id_of(rec.run_id, rec.episode_id) if self.warehouse is not None else None
        self._score_rows[ep_id] = score_row(rec, task, r, write_id=wid)
        return out | {"reward": r.score, "reward_reason": r.reason, "verifier": r.verifier}

    # -- the stream ---------------------------------------------------------------------
    def _fan_out(self, run: RunHandle, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        """The engine's fan-out (RunHandle.fan_out, a thread of its own): every episode's
        events onto `queue` as it ends, then None; an error (a full warehouse disk, a bug)
        ends the stream with an `error` event instead of `done`."""
        try:
            progress.planned(total=len(self.episodes), skipped=0, run_id=self.run_id)
            fan_out = run.fan_out(self.executor, self._attempt, self.episodes,
                                  policy=self.policy, budget=self.budget_spec)  # fmt: skip
            with contextlib.closing(fan_out) as results:
                for ep, res in results:
                    events = self._events_of(ep, res)
                    loop.call_soon_threadsafe(queue.put_nowait, (ep.task, events))
        except Exception as exc:
            log.warning("rollout batch %s stopped: %s", self.run_id, exc, exc_info=True)
            error = {"type": "error", "run_id": self.run_id, "error": f"{type(exc).__name__}: {exc}"}
            loop.call_soon_threadsafe(queue.put_nowait, error)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """`start`, then a `trajectory` per episode as it ends (with `group` events once a
        task's samples are all in), then `done` (or `error`, when the fan-out failed).
        Cancelled when the consumer goes away. After `begin`."""
        if self.run is None:
            raise RuntimeError(f"batch {self.run_id}: begin() before events()")
        run = self.run
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
            target=self._fan_out, args=(run, loop, queue), name=f"rollout-{self.run_id}", daemon=True
        )
        self._fan_out_thread = fan_out
        fan_out.start()
        scores: list[dict[str, Any]] = []
        complete = False
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, dict):  # the fan-out failed: the stream ends here
                    yield item
                    return
                task, events = item
                group = groups[task.id]
                trajectories = [e for e in events if e["type"] == "trajectory"]
                group.expected += len(trajectories) - 1  # a tree: one sample, several leaves
                for event in events:
                    yield event
                for event in trajectories:
                    self.counts[event["status"]] += 1
                    row = self._score_rows.pop(event["episode_id"], None)
                    if event["status"] == "ok" and row is not None:
                        scores.append(row)
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
        budget = self.budget
        if budget is not None:
            # {max_cost_usd, max_run_tokens, spent_tokens, spent_usd, exhausted}
            out["budget"] = budget.summary()
        if self.budget_spent:
            out["stopped"] = budgets.TERMINATION
            out["reason"] = self.cancel_event.reason
        return out

