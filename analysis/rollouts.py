"""Training-ready RL data from runs, in three shapes (rows only: flows/rollouts.py writes
them as Parquet through warehouse.write_export, each `datasets`-loadable).

1. Task sets in the shape verl / rllm read for LLM-in-Sandbox-RL style training (the
   rows are datasets_prep.rows', the one contract between a row and a Task, which also
   reads them back; flows/rollouts.py writes them, prompts from `sandbox_prompt`).
2. Trajectories as chat messages with tool calls, one row per episode: a per-message
   loss mask (assistant 1, everything the environment or user said 0), the reward,
   GRPO and RLOO advantages over the samples of the same task and mode, the
   termination reason, and an over-length flag / filter.
3. Token-level rows (prompt ids, response ids, response mask, logprobs) for episodes
   whose turns carry the server's token ids. The response is rebuilt from the turns:
   each completion (mask 1, its logprobs) followed by the environment's tokens, taken
   from the next request's prompt ids (mask 0). That only works if every request
   extends the previous one exactly (the append-only history); an episode where it
   does not, or where counts disagree with the recorded usage, is reported and left
   out rather than silently re-tokenized. The assembly is analysis.token_ids', the one
   the rollout server uses too; `logprobs` is null when a turn came without them.

Infrastructure failures (model_error, sandbox_error, interrupted) are never exported:
they are not the model's behaviour. Advantages are computed over the group BEFORE the
over-length filter, so a truncated sample still counts in its group's baseline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pyarrow as pa

from analysis.advantages import group_advantages
from analysis.token_ids import Detokenize, assemble
from datasets_prep.task import Task
from tasks.records import EpisodeRecord, TurnRecord
from warehouse.rundata import RunData
from warehouse.schema import EPISODES

OverlongPolicy = Literal["drop", "mask", "keep"]

# ---------------------------------------------------------------------------- schemas
_TOOL_CALL = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("type", pa.string()),
        pa.field("function", pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])),
    ]
)
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


# the reward and the advantages over its group (analysis.advantages), in both exports
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
        pa.field("logprobs", pa.list_(pa.float64())),
        *_REWARD,
        *_episode_columns("termination", "num_turns"),
        pa.field("overlong", pa.bool_()),
    ]
)


class RolloutError(ValueError):
    """The run cannot be exported as asked (no scores, nothing left after filtering...)."""


# -------------------------------------------------------------------- (2) trajectories
def turn_messages(turn: TurnRecord) -> list[dict[str, Any]]:
    """The messages one turn appended to the history: the assistant's, then the tools'."""
    msgs: list[dict[str, Any]] = [
        {
            "role": "assistant",
            "content": turn.assistant_content or "",
            "reasoning_content": turn.reasoning_content,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in turn.tool_calls
            ],
            "tool_call_id": None,
            "name": None,
        }
    ]
    for o in turn.observations:
        msgs.append(
            {
                "role": "tool",
                "content": o.content,
                "reasoning_content": None,
                "tool_calls": [],
                "tool_call_id": o.tool_call_id,
                "name": o.name,
            }
        )
    for m in turn.extra_messages:
        msgs.append(_normalise(m))
    return msgs


def _normalise(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False) if content is not None else ""
    return {
        "role": str(m.get("role", "user")),
        "content": content,
        "reasoning_content": m.get("reasoning_content"),
        "tool_calls": [
            {
                "id": c.get("id"),
                "type": c.get("type", "function"),
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": (c.get("function") or {}).get("arguments"),
                },
            }
            for c in (m.get("tool_calls") or [])
        ],
        "tool_call_id": m.get("tool_call_id"),
        "name": m.get("name"),
    }


def episode_messages(episode: EpisodeRecord, turns: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    msgs = [_normalise(m) for m in episode.prompt_messages]
    for t in turns:
        msgs.extend(turn_messages(t))
    return msgs


def loss_mask(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Train on what the policy wrote (assistant), never on what it was given."""
    return [1 if m["role"] == "assistant" else 0 for m in messages]


def seq_tokens(episode: EpisodeRecord, turns: Sequence[TurnRecord]) -> int:
    """Length of the whole conversation in tokens: the last request plus its completion."""
    if turns:
        last = turns[-1]
        if last.prompt_token_ids is not None and last.completion_token_ids is not None:
            return len(last.prompt_token_ids) + len(last.completion_token_ids)
        if last.usage.prompt_tokens is not None:
            return int(last.usage.prompt_tokens) + int(last.usage.completion_tokens or 0)
    return int(episode.prompt_tokens) + int(episode.completion_tokens)


def is_overlong(
    episode: EpisodeRecord, turns: Sequence[TurnRecord], max_seq_tokens: int | None
) -> bool:
    if episode.termination == "context_exhausted":
        return True
    if any(t.finish_reason == "length" for t in turns):
        return True
    return max_seq_tokens is not None and seq_tokens(episode, turns) > max_seq_tokens


@dataclass
class ExportStats:
    exported: int = 0
    skipped_infra: int = 0
    skipped_unscored: int = 0
    dropped_overlong: int = 0
    masked_overlong: int = 0
    token_rows: int = 0
    token_mismatches: list[str] = field(default_factory=list)  # "episode_id: why"

    def as_dict(self) -> dict[str, Any]:
        """Every count, in field order; the token mismatches counted (their text stays here)."""
        return {**asdict(self), "token_mismatches": len(self.token_mismatches)}


def _scored_episodes(data: RunData, stats: ExportStats) -> list[EpisodeRecord]:
    if not data.scores:
        raise RolloutError(
            f"run {data.run_id!r} has no scores yet: run `sandflow flows score --run-id {data.run_id}` first"
        )
    eps = []
    for e in data.episodes:
        if e.is_infra_failure or e.termination is None:
            stats.skipped_infra += 1
        elif e.episode_id not in data.scores:
            stats.skipped_unscored += 1
        else:
            eps.append(e)
    return eps


def _advantages(data: RunData, eps: Sequence[EpisodeRecord]) -> tuple[list[float], list[float], list[int]]:
    keys = [(e.task_id, e.mode) for e in eps]
    rewards = [data.scores[e.episode_id].score for e in eps]
    sizes = [keys.count(k) for k in keys]
    return group_advantages(keys, rewards, "grpo"), group_advantages(keys, rewards, "rloo"), sizes


def trajectory_rows(
    data: RunData,
    *,
    max_seq_tokens: int | None = None,
    overlong: OverlongPolicy = "drop",
    stats: ExportStats | None = None,
) -> list[dict[str, Any]]:
    stats = stats if stats is not None else ExportStats()
    eps = _scored_episodes(data, stats)
    grpo, rloo, sizes = _advantages(data, eps)
    rows = []
    for e, a_g, a_r, n in zip(eps, grpo, rloo, sizes, strict=True):
        turns = data.turns_of(e.episode_id)
        msgs = episode_messages(e, turns)
        mask = loss_mask(msgs)
        long = is_overlong(e, turns, max_seq_tokens)
        if long and overlong == "drop":
            stats.dropped_overlong += 1
            continue
        if long and overlong == "mask":
            mask = [0] * len(mask)
            stats.masked_overlong += 1
        rows.append(
            {
                **e.identity(),
                "model": e.model,
                "messages": msgs,
                "loss_mask": mask,
                "reward": data.scores[e.episode_id].score,
                "advantage_grpo": a_g,
                "advantage_rloo": a_r,
                "group_size": n,
                "termination": e.termination,
                "num_turns": len(turns),
                "seq_tokens": seq_tokens(e, turns),
                "overlong": long,
            }
        )
    stats.exported = len(rows)
    return rows


# ------------------------------------------------------------------- (3) token level
def token_rows(
    data: RunData,
    *,
    max_seq_tokens: int | None = None,
    overlong: OverlongPolicy = "drop",
    detokenize: Detokenize | None = None,
    stats: ExportStats | None = None,
) -> list[dict[str, Any]]:
    stats = stats if stats is not None else ExportStats()
    eps = _scored_episodes(data, ExportStats())
    grpo, rloo, _ = _advantages(data, eps)
    rows = []
    for e, a_g, a_r in zip(eps, grpo, rloo, strict=True):
        turns = data.turns_of(e.episode_id)
        tokens = assemble(turns, detokenize)
        if tokens.status == "missing":
            continue
        if not tokens.exact:
            stats.token_mismatches.append(f"{e.episode_id}: {tokens.status}")
            continue
        prompt, response = tokens.prompt_ids or [], tokens.response_ids or []
        mask, lps = tokens.response_mask or [], tokens.response_logprobs
        long = is_overlong(e, turns, max_seq_tokens)
        if long and overlong == "drop":
            continue
        if long and overlong == "mask":
            mask = [0] * len(mask)
        rows.append(
            {
                "run_id": e.run_id,
                "episode_id": e.episode_id,
                "task_id": e.task_id,
                "mode": e.mode,
                "sample_index": e.sample_index,
                "prompt_ids": prompt,
                "response_ids": response,
                "response_mask": mask,
                "logprobs": lps,
                "reward": data.scores[e.episode_id].score,
                "advantage_grpo": a_g,
                "advantage_rloo": a_r,
                "termination": e.termination,
                "num_turns": len(turns),
                "overlong": long,
            }
        )
    stats.token_rows = len(rows)
    return rows


# ------------------------------------------------------------------ task-set export
def sandbox_prompt(task: Task) -> list[dict[str, Any]]:
    """The messages a sandbox-mode episode starts from (tasks' own templates)."""
    from tasks.prompts import load_prompts

    return load_prompts(task.domain, None).sandbox_messages(task)

