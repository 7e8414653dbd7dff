"""One episode's trajectory in every shape it leaves sandflow in (issue #38: "one trajectory module").

Read it top to bottom: it is the path of a recorded episode (its EpisodeRecord and
TurnRecords) to training data, and each step has one home.

1. turns -> chat messages (with the tools list) -> loss mask: tasks/conversation.py
   (`episode_messages`, `tools_of`, `loss_mask`; below analysis because the replay
   rebuilds the loop's history with the same rule).
2. -> token ids: analysis/token_ids.py (`assemble`: one exact sequence, or why not);
   `token_fields` here names its columns.
3. -> reward: `reward` (the task's verifier, datasets_prep.verifiers): the one
   computation behind `sandflow flows score`, the rollout server, the step-wise env and
   TRL's reward.
4. -> score row: `score_row`, the warehouse's `scores` shape, whoever scored.
5. -> rows: `rl_row` (messages + loss mask + reward + advantages: trajectories.parquet),
   `token_row` (tokens.parquet), `rollout_fields` (the rollout server's trajectory
   event), `sft_row` (SFT JSONL: messages + tools). The ATIF, Inspect and Hugging Face
   exports (interop/) map the same messages, in the same order (tasks.conversation's
   `turn_parts`), into their formats.

The same column names everywhere: `messages`, `loss_mask` (per message), `prompt_ids`,
`response_ids`, `response_mask`, `response_logprobs` (per response token, verl's
AgentLoopOutput names), `reward`, `overlong`, `termination`, `num_turns`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from analysis.token_ids import TokenTrajectory, assemble
from datasets_prep.task import Task
from datasets_prep.verifiers.base import VerifierError
from tasks.conversation import episode_messages, loss_mask, tools_of
from tasks.records import EpisodeRecord, TurnRecord
from tasks.replies import read_arguments
from warehouse.schema import EPISODES

if TYPE_CHECKING:  # the verifiers are imported when a reward is computed, not before
    from datasets_prep.verifiers import JudgeEndpoint

# ---------------------------------------------------------------------------- schemas
_TOOL_CALL = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("type", pa.string()),
        pa.field("function", pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])),
    ]
)
# tasks.conversation's row shape: every message has these six keys
MESSAGE = pa.struct(
    [
        pa.field("role", pa.string()),
        pa.field("content", pa.string()),
        pa.field("reasoning_content", pa.string()),
        pa.field("tool_calls", pa.list_(_TOOL_CALL)),
        pa.field("tool_call_id", pa.string()),
        pa.field("name", pa.string()),
    ]
)


def _episode_columns(*names: str) -> list[pa.Field]:
    """Columns that are an episode's own, typed as the warehouse stores them
    (warehouse.schema.EPISODES): one definition of their types."""
    return [pa.field(name, EPISODES.field(name).type) for name in names]


# the reward and the advantages over its group (analysis.advantages), in both RL files
_REWARD = [
    pa.field("reward", pa.float64()),
    pa.field("advantage_grpo", pa.float64()),
    pa.field("advantage_rloo", pa.float64()),
]

TRAJECTORY_SCHEMA = pa.schema(
    [
        *_episode_columns("run_id", "episode_id", "task_id", "domain", "mode", "sample_index", "model"),
        pa.field("messages", pa.list_(MESSAGE)),
        pa.field("loss_mask", pa.list_(pa.int8())),
        *_REWARD,
        pa.field("group_size", pa.int32()),
        *_episode_columns("termination", "num_turns"),
        pa.field("seq_tokens", pa.int64()),
        pa.field("overlong", pa.bool_()),
    ]
)

TOKEN_SCHEMA = pa.schema(
    [
        *_episode_columns("run_id", "episode_id", "task_id", "mode", "sample_index"),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("response_mask", pa.list_(pa.int8())),
        pa.field("response_logprobs", pa.list_(pa.float64())),
        *_REWARD,
        *_episode_columns("termination", "num_turns"),
        pa.field("overlong", pa.bool_()),
    ]
)


# ---------------------------------------------------------------------------- reward
class RewardError(VerifierError):
    """The task's ground truth or verifier is unusable: not the answer's fault. Never a
    silent 0 (a trainer must not learn from it); the message names the task."""


@dataclass(frozen=True)
class Reward:
    score: float  # 0..1
    reason: str
    verifier: str  # the verifier that gave it (the task's own when none was asked for)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.score >= 1.0


def reward(
    task: Task, answer: str | None, verifier: str | None = None, *, judge: JudgeEndpoint | None = None
) -> Reward:
    """The episode's reward: `answer` checked by `verifier` (None or "auto": the task's
    own, datasets_prep.verifiers.choose). A wrong or missing answer scores 0 with a
    reason; an unusable ground truth or verifier raises RewardError. Pure and safe in any
    thread (the judge, when it is the verifier, calls its endpoint)."""
    from datasets_prep.verifiers import choose, score

    try:
        r = score(task, answer, verifier, judge=judge)
        name = r.verifier or (choose(task) if verifier in (None, "", "auto") else str(verifier))
    except VerifierError as exc:
        raise RewardError(f"task {task.id!r}: {exc}") from None
    return Reward(score=float(r.score), reason=r.reason, verifier=name, details=dict(r.details or {}))


def check_scorable(task: Task, verifier: str | None = None) -> str:
    """The verifier that will score `task`; RewardError unless it can (a ground truth, one
    its verifier can use): a task set that cannot reward is refused before any rollout."""
    from datasets_prep.task import check_scorable as check

    try:
        return check(task, verifier)
    except VerifierError as exc:
        raise RewardError(str(exc)) from None


def score_row(
    episode: EpisodeRecord, task: Task, r: Reward, *, write_id: str | None = None
) -> dict[str, Any]:
    """The warehouse's score row (warehouse.labels.ScoreRow) of `episode` judged by `r`.
    `write_id`: the recording attempt judged (RunData.attempts, or Warehouse.write_id_of
    right after recording: the rollout server, the step-wise env); None when the scorer
    does not know it (the `scores` view then judges staleness by time)."""
    return {
        "run_id": episode.run_id,
        "episode_id": episode.episode_id,
        "verifier": r.verifier,
        "score": r.score,
        "passed": r.passed,
        "reason": r.reason,
        "answer": episode.answer,
        "ground_truth": task.ground_truth,
        "details": dict(r.details),
        "episode_write_id": write_id,
    }


# ---------------------------------------------------------------------------- lengths
def seq_tokens(episode: EpisodeRecord, turns: Sequence[TurnRecord]) -> int:
    """Length of the whole conversation in tokens: the last request plus its completion."""
    if turns:
        last = turns[-1]
        if last.prompt_token_ids is not None and last.completion_token_ids is not None:
            return len(last.prompt_token_ids) + len(last.completion_token_ids)
        if last.usage.prompt_tokens is not None:
            return int(last.usage.prompt_tokens) + int(last.usage.completion_tokens or 0)
    return int(episode.prompt_tokens) + int(episode.completion_tokens)


def is_overlong(episode: EpisodeRecord, turns: Sequence[TurnRecord], max_seq_tokens: int | None = None) -> bool:
    """Cut short by length: the context ran out, a completion stopped at max_tokens, or
    (with `max_seq_tokens`) the conversation is longer than that."""
    if episode.termination == "context_exhausted":
        return True
    if any(t.finish_reason == "length" for t in turns):
        return True
    return max_seq_tokens is not None and seq_tokens(episode, turns) > max_seq_tokens


# ---------------------------------------------------------------------------- rows
def token_fields(tokens: TokenTrajectory) -> dict[str, Any]:
    """The token columns of a trajectory (None each when it has no exact ids)."""
    return {
        "token_ids_status": tokens.status,
        "prompt_ids": tokens.prompt_ids,
        "response_ids": tokens.response_ids,
        "response_mask": tokens.response_mask,
        "response_logprobs": tokens.response_logprobs,
    }


def rl_row(
    episode: EpisodeRecord,
    turns: Sequence[TurnRecord],
    reward_score: float,
    *,
    advantages: tuple[float, float] = (0.0, 0.0),
    group_size: int = 1,
    overlong: bool = False,
    masked: bool = False,
) -> dict[str, Any]:
    """One row of trajectories.parquet (TRAJECTORY_SCHEMA): the conversation with its loss
    mask (all 0 when `masked`: an over-length sample kept for its group), the reward,
    the GRPO and RLOO advantages over its group (analysis.advantages)."""
    msgs = episode_messages(episode, turns)
    mask = loss_mask(msgs)
    return {
        **episode.identity(),
        "model": episode.model,
        "messages": msgs,
        "loss_mask": [0] * len(mask) if masked else mask,
        "reward": reward_score,
        "advantage_grpo": advantages[0],
        "advantage_rloo": advantages[1],
        "group_size": group_size,
        "termination": episode.termination,
        "num_turns": len(turns),
        "seq_tokens": seq_tokens(episode, turns),
        "overlong": overlong,
    }


def token_row(
    episode: EpisodeRecord,
    turns: Sequence[TurnRecord],
    tokens: TokenTrajectory,
    reward_score: float,
    *,
    advantages: tuple[float, float] = (0.0, 0.0),
    overlong: bool = False,
    masked: bool = False,
) -> dict[str, Any]:
    """One row of tokens.parquet (TOKEN_SCHEMA) from an exact `tokens` (analysis.token_ids)."""
    fields = token_fields(tokens)
    del fields["token_ids_status"]
    if masked:
        fields["response_mask"] = [0] * len(fields["response_mask"] or [])
    return {
        "run_id": episode.run_id,
        "episode_id": episode.episode_id,
        "task_id": episode.task_id,
        "mode": episode.mode,
        "sample_index": episode.sample_index,
        **fields,
        "reward": reward_score,
        "advantage_grpo": advantages[0],
        "advantage_rloo": advantages[1],
        "termination": episode.termination,
        "num_turns": len(turns),
        "overlong": overlong,
    }


def rollout_fields(
    episode: EpisodeRecord, turns: Sequence[TurnRecord], messages: Sequence[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The trajectory part of the rollout server's `trajectory` event: the messages (a
    live episode's own history when given, else rebuilt), their loss mask, the token
    columns, `overlong`. The reward and the rest of the event are rl.batch's."""
    msgs = list(messages) if messages is not None else episode_messages(episode, turns, wire=True)
    return {
        "messages": msgs,
        "loss_mask": loss_mask(msgs),
        **token_fields(assemble(turns)),
        "overlong": is_overlong(episode, turns),
    }


def sft_message(m: dict[str, Any]) -> dict[str, Any]:
    """A row-shape message as SFT chat data (TRL's SFTTrainer, LLaMA-Factory): only the
    keys a message of its role has; tool-call arguments as an object (chat templates
    render them with tojson), kept as their text when they are not a JSON object
    (tasks.replies.read_arguments' rule)."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = []
        for c in calls:
            fn = c.get("function") or {}
            raw = fn.get("arguments")
            args, problem = read_arguments(raw)
            out["tool_calls"].append({"id": c.get("id"), "type": "function", "function": {
                "name": fn.get("name"), "arguments": (raw or "") if problem else args}})  # fmt: skip
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
        if m.get("name"):
            out["name"] = m["name"]
    return out


def sft_row(episode: EpisodeRecord, turns: Sequence[TurnRecord], reward_score: float) -> dict[str, Any]:
    """One SFT JSONL row: {"messages", "tools"} (the layout TRL and LLaMA-Factory read),
    with the task, episode and reward beside them."""
    return {
        "messages": [sft_message(m) for m in episode_messages(episode, turns)],
        "tools": tools_of(episode.mode, episode.config, episode_id=episode.episode_id),
        "task_id": episode.task_id,
        "episode_id": episode.episode_id,
        "reward": reward_score,
    }


__all__ = [
    "MESSAGE", "TOKEN_SCHEMA", "TRAJECTORY_SCHEMA", "Reward", "RewardError",
    "check_scorable", "is_overlong", "reward", "rl_row", "rollout_fields", "score_row",
    "seq_tokens", "sft_message", "sft_row", "token_fields", "token_row",
]  # fmt: skip
