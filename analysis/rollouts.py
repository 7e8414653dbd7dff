"""Training-ready RL data from a run, in three shapes (rows only: flows/rollouts.py writes
them as Parquet through warehouse.write_export, each `datasets`-loadable).

Which episodes, and their group's advantages, are decided here; each row's shape is
analysis.trajectory's (one episode -> messages, loss mask, tokens, reward, rows).

1. Task sets in the shape verl / rllm read for LLM-in-Sandbox-RL style training (the
   rows are datasets_prep.rows', the one contract between a row and a Task, which also
   reads them back; flows/rollouts.py writes them, prompts from `sandbox_prompt`).
2. Trajectories as chat messages with tool calls, one row per episode
   (analysis.trajectory.rl_row): a per-message loss mask (assistant 1, everything the
   environment or user said 0), the reward, GRPO and RLOO advantages over the samples
   of the same task and mode, the termination reason, and an over-length flag / filter.
3. Token-level rows (analysis.trajectory.token_row: prompt ids, response ids, response
   mask, response logprobs) for episodes whose turns carry the server's token ids. The
   response is rebuilt from the turns by analysis.token_ids (the one assembly, the
   rollout server's too); an episode whose ids do not extend exactly, or disagree with
   the recorded usage, is reported and left out rather than silently re-tokenized;
   `response_logprobs` is null when a turn came without them.

Infrastructure failures (model_error, sandbox_error, interrupted) are never exported:
they are not the model's behaviour. Advantages are computed over the group BEFORE the
over-length filter, so a truncated sample still counts in its group's baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from analysis.advantages import group_advantages
from analysis.token_ids import Detokenize, assemble
from analysis.trajectory import is_overlong, rl_row, token_row
from datasets_prep.task import Task
from tasks.records import EpisodeRecord
from warehouse.rundata import RunData

OverlongPolicy = Literal["drop", "mask", "keep"]


class RolloutError(ValueError):
    """The run cannot be exported as asked (no scores, nothing left after filtering...)."""


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
    """The run's trajectories.parquet rows (analysis.trajectory.TRAJECTORY_SCHEMA)."""
    stats = stats if stats is not None else ExportStats()
    eps = _scored_episodes(data, stats)
    grpo, rloo, sizes = _advantages(data, eps)
    rows = []
    for e, a_g, a_r, n in zip(eps, grpo, rloo, sizes, strict=True):
        turns = data.turns_of(e.episode_id)
        long = is_overlong(e, turns, max_seq_tokens)
        if long and overlong == "drop":
            stats.dropped_overlong += 1
            continue
        masked = long and overlong == "mask"
        stats.masked_overlong += masked
        rows.append(rl_row(e, turns, data.scores[e.episode_id].score, advantages=(a_g, a_r),
                           group_size=n, overlong=long, masked=masked))  # fmt: skip
    stats.exported = len(rows)
    return rows


def token_rows(
    data: RunData,
    *,
    max_seq_tokens: int | None = None,
    overlong: OverlongPolicy = "drop",
    detokenize: Detokenize | None = None,
    stats: ExportStats | None = None,
) -> list[dict[str, Any]]:
    """The run's tokens.parquet rows (analysis.trajectory.TOKEN_SCHEMA): the episodes
    whose token ids form one exact sequence."""
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
        long = is_overlong(e, turns, max_seq_tokens)
        if long and overlong == "drop":
            continue
        rows.append(token_row(e, turns, tokens, data.scores[e.episode_id].score, advantages=(a_g, a_r),
                              overlong=long, masked=long and overlong == "mask"))  # fmt: skip
    stats.token_rows = len(rows)
    return rows


# ------------------------------------------------------------------ task-set export
def sandbox_prompt(task: Task) -> list[dict[str, Any]]:
    """The messages a sandbox-mode episode starts from (tasks' own templates)."""
    from tasks.prompts import load_prompts

    return load_prompts(task.domain, None).sandbox_messages(task)
