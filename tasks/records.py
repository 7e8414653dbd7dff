"""What an episode leaves behind: the records the warehouse stores.

The agent loop produces these; `warehouse/` turns them into Parquet. Data flows
one way: tasks -> warehouse. Token ids and logprobs are kept exactly as the
server returned them (RL needs exact tokens, not re-tokenized text). No field
ever holds an API key.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, field_validator

Mode = Literal["sandbox", "llm"]
BranchKind = Literal["fork", "replay"]  # how a child episode got its parent's state
Termination = Literal[
    "submitted",  # the model called submit (or, in LLM mode, answered)
    "max_steps",
    "context_exhausted",
    "wall_clock",
    "model_error",  # the endpoint failed after retries: infrastructure, not the model's answer
    "sandbox_error",  # the sandbox/engine failed: infrastructure
    "interrupted",  # Ctrl+C / SIGTERM: the episode is partial and will be re-run on resume
    "budget_exhausted",  # the run's --max-cost / --max-run-tokens was reached: partial, re-run on resume
]
INFRA_TERMINATIONS: frozenset[str] = frozenset(
    {"model_error", "sandbox_error", "interrupted", "budget_exhausted"}
)


def episode_key(run_id: str, task_id: str, mode: str, sample_index: int) -> str:
    """Stable id of an episode: the same (run, task, mode, sample) is stored once."""
    raw = f"{run_id}\x1f{task_id}\x1f{mode}\x1f{sample_index}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


class ToolCall(BaseModel):
    id: str
    name: str
    arguments: str  # raw JSON text as the model produced it (may be invalid)


class Observation(BaseModel):
    """One tool call's result as given back to the model."""

    tool_call_id: str
    name: str
    content: str
    exit_code: int | None = None
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    error: str | None = None  # e.g. "invalid JSON arguments", "unknown tool"
    duration_s: float = 0.0


# A token count outside [0, this] is not a count any model call produced (the longest
# contexts served are ~10^7 tokens): it is unknown (None), never summed, priced or stored.
MAX_TOKEN_COUNT = 1_000_000_000


def bounded_count(value: Any) -> int | None:
    """`value` if it is a token count (an integer in [0, MAX_TOKEN_COUNT]), else None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= MAX_TOKEN_COUNT else None


class Usage(BaseModel):
    """What a server said a call used. Every count is bounded wherever a Usage is made
    (a reply, a journal line, a stored row): an impossible one is unknown (None)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> int | None:
        return bounded_count(value)


class Spend(BaseModel):
    """What earlier attempts of an episode paid for, all of them since replaced by a later
    attempt (each re-run carries its predecessor's spend on: the money stays counted,
    engine/budget.py). Token sums are over the turns whose server reported usage."""

    attempts: int = 0
    turns: int = 0
    unreported_turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def plus_turns(self, turns: list[TurnRecord]) -> Spend:
        """This spend and one more attempt's `turns` (inherited ones excluded by the caller)."""
        out = self.model_copy(update={"attempts": self.attempts + 1})
        for t in turns:
            u = t.usage
            out.turns += 1
            if u.prompt_tokens is None or u.completion_tokens is None:
                out.unreported_turns += 1
                continue
            out.prompt_tokens += u.prompt_tokens
            out.completion_tokens += u.completion_tokens
            out.cached_tokens += min(u.cached_tokens or 0, u.prompt_tokens)
            out.reasoning_tokens += min(u.reasoning_tokens or 0, u.completion_tokens)
        return out


class EgressRequest(BaseModel):
    """One request the sandbox made through the egress proxy (network allowlist / open),
    attributed to the turn during which it ended (sandbox/egress.py)."""

    time: datetime
    method: str
    host: str
    port: int
    url: str | None = None  # for HTTPS only host:port is visible (a CONNECT tunnel)
    status: int | None = None
    bytes_out: int = 0  # sandbox -> outside
    bytes_in: int = 0  # outside -> sandbox
    allowed: bool
    rule: str  # the policy entry that allowed it, or why it was refused
    result: str | None = None  # the proxy's result code (TCP_MISS, TCP_MEM_HIT, TCP_DENIED...)


class TurnRecord(BaseModel):
    """One model call and everything that came of it."""

    run_id: str
    episode_id: str
    turn_index: int
    started_at: datetime
    assistant_content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    observations: list[Observation] = Field(default_factory=list)
    # Non-tool messages appended after the assistant message (e.g. the continue prompt).
    extra_messages: list[dict[str, Any]] = Field(default_factory=list)
    finish_reason: str | None = None
    model_latency_s: float = 0.0
    tool_latency_s: float = 0.0
    usage: Usage = Field(default_factory=Usage)
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    error: str | None = None
    # Added by the episode loop (defaults keep older rows valid):
    request_max_tokens: int | None = None  # max_tokens sent (shrinks after a context error)
    attempts: int = 1  # HTTP attempts the model call took (retries on 429/5xx/timeouts)
    egress: list[EgressRequest] = Field(default_factory=list)  # network allowlist / open only


class EpisodeRecord(BaseModel):
    """The episode's summary; written once when it ends (atomically)."""

    run_id: str
    episode_id: str
    task_id: str
    domain: str
    mode: Mode
    sample_index: int = 0
    model: str
    started_at: datetime
    ended_at: datetime | None = None
    termination: Termination | None = None
    error: str | None = None
    answer: str | None = None
    # The request prefix every turn extends: system + first user message (JSON list).
    prompt_messages: list[dict[str, Any]] = Field(default_factory=list)
    num_turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    model_s: float = 0.0
    tool_s: float = 0.0
    config: dict[str, Any] = Field(default_factory=dict)  # sampling params etc., never secrets
    # Added by the episode loop (defaults keep older rows valid):
    reasoning_tokens: int = 0
    answer_source: str | None = None  # answer_file | submit_argument | last_message | reply
    # RL rollouts (rl/): which training run, step and policy produced the episode, and
    # whether its token ids form one exact sequence ("exact" | "missing" | "mismatch at
    # turn N: why"). None elsewhere.
    training_run: str | None = None
    training_step: int | None = None
    policy_version: str | None = None
    token_ids_status: str | None = None
    # The output folder's export (sandbox.archive.ExportSummary.as_dict()): files, bytes,
    # and what was left out, counted per reason with a few names. None when not exported.
    output_export: dict[str, Any] | None = None
    # What the sandbox used, from its cgroup (sandbox/usage.py): CPU-seconds of this
    # episode and the peak memory in bytes (a pooled sandbox's: since it started). None:
    # LLM mode, or the backend cannot tell (unknown, never 0).
    sandbox_cpu_s: float | None = None
    sandbox_peak_memory_bytes: int | None = None
    # Where it ran (None in older rows): the machine whose process drove the episode and
    # the engine its sandbox ran on (sandbox.engine.engine_of: "docker unix:///...",
    # "docker tcp://host2:2375", "bwrap"; None in llm mode). With several engines or
    # hosts, `GROUP BY worker_host, sandbox_engine` shows which one fails or lags.
    worker_host: str | None = None
    sandbox_engine: str | None = None
    # Lineage (issue #25; None for an episode that started from its task): the episode this
    # one branched from, the first turn it produced itself (its turns before `branch_turn`
    # are the parent's, message for message) and how the parent's state was carried over:
    # "fork" (the live sandbox copied, sandbox.fork) or "replay" (the recorded tool calls
    # re-run in a fresh sandbox, tasks.replay). The `episode_tree` view reads them.
    parent_run_id: str | None = None
    parent_episode_id: str | None = None
    branch_turn: int | None = None
    branch_kind: BranchKind | None = None
    # What the earlier attempts of this episode (re-run: an infrastructure failure, a
    # stopped budget) paid, carried on by each attempt (None: the first attempt).
    replaced: Spend | None = None

    @property
    def is_infra_failure(self) -> bool:
        return self.termination in INFRA_TERMINATIONS

    def identity(self) -> dict[str, Any]:
        """Which episode this is: the keys every export row and every format carries
        (RL rows, Hugging Face rows, ATIF, Inspect logs), in this order."""
        return {
            "run_id": self.run_id,
            "episode_id": self.episode_id,
            "task_id": self.task_id,
            "domain": self.domain,
            "mode": self.mode,
            "sample_index": self.sample_index,
        }

    def with_totals(self, turns: list[TurnRecord], *, only_missing: bool = False) -> EpisodeRecord:
        """This record with its totals taken from `turns` (see `episode_totals`).

        only_missing: keep the numbers already given and fill only those left at zero (the
        warehouse commits a recovered journal's header, which has none, the same way).
        """
        totals = episode_totals(turns)
        if only_missing:
            if not turns:
                return self
            groups = (
                ("num_turns",),
                ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens"),
                ("model_s",),
                ("tool_s",),
            )
            totals = {
                name: totals[name]
                for group in groups
                if not any(getattr(self, name) for name in group)
                for name in group
            }
        return self.model_copy(update=totals) if totals else self


def episode_totals(turns: list[TurnRecord]) -> dict[str, Any]:
    """An episode's totals from its turns: the ONE definition (the loop and the warehouse use it)."""
    return {
        "num_turns": len(turns),
        "prompt_tokens": sum(t.usage.prompt_tokens or 0 for t in turns),
        "completion_tokens": sum(t.usage.completion_tokens or 0 for t in turns),
        "cached_tokens": sum(t.usage.cached_tokens or 0 for t in turns),
        "reasoning_tokens": sum(t.usage.reasoning_tokens or 0 for t in turns),
        "model_s": sum(t.model_latency_s for t in turns),
        "tool_s": sum(t.tool_latency_s for t in turns),
    }


class Recorder(Protocol):
    """Where an episode writes as it goes. warehouse.EpisodeWriter implements it."""

    def start_episode(self, episode: EpisodeRecord) -> None: ...

    def record_turn(self, turn: TurnRecord) -> None: ...

    def finish_episode(self, episode: EpisodeRecord) -> None: ...


class NullRecorder:
    """Keeps records in memory; for `sandflow run` without a warehouse and for tests."""

    def __init__(self) -> None:
        self.episodes: list[EpisodeRecord] = []
        self.turns: list[TurnRecord] = []

    def start_episode(self, episode: EpisodeRecord) -> None:
        pass

    def record_turn(self, turn: TurnRecord) -> None:
        self.turns.append(turn)

    def finish_episode(self, episode: EpisodeRecord) -> None:
        self.episodes.append(episode)
