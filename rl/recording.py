"""Recording RL rollouts: the training tags on every episode, and the token-id verdict.

`RolloutRecorder` wraps the warehouse's Recorder (or any): it stamps each episode with
the training run, step and policy version (`RolloutTags`), sets `token_ids_status` from
the turns' ids (analysis.token_ids) just before the episode is committed, and, when the episode
was cancelled (the trainer disconnected), records an infrastructure ending as
`interrupted`: the trainer stopped it, nothing broke.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from analysis.token_ids import assemble
from tasks.records import INFRA_TERMINATIONS, EpisodeRecord, Recorder, TurnRecord


class RolloutTags(BaseModel):
    """Which training produced a rollout (columns of the warehouse's episodes table)."""

    training_run: str | None = Field(None, max_length=200, description="the trainer's run name")
    step: int | None = Field(None, ge=0, description="the training step")
    policy_version: str | None = Field(
        None, max_length=200, description="the policy's weights version"
    )


class RolloutRecorder:
    """A Recorder that tags episodes and checks their token ids (thread-safe)."""

    def __init__(
        self,
        inner: Recorder,
        tags: RolloutTags | None = None,
        cancelled: Callable[[str], bool] | None = None,
    ) -> None:
        self.inner = inner
        self.tags = tags or RolloutTags()
        self.cancelled = cancelled or (lambda episode_id: False)
        self._turns: dict[str, list[TurnRecord]] = {}
        self._lock = threading.Lock()

    def tag(self, episode: EpisodeRecord, tags: RolloutTags | None = None) -> None:
        t = tags or self.tags
        episode.training_run = t.training_run
        episode.training_step = t.step
        episode.policy_version = t.policy_version

    def start_episode(self, episode: EpisodeRecord) -> None:
        if episode.training_run is None and episode.policy_version is None:
            self.tag(episode)
        with self._lock:
            self._turns[episode.episode_id] = []
        self.inner.start_episode(episode)

    def record_turn(self, turn: TurnRecord) -> None:
        with self._lock:
            self._turns.setdefault(turn.episode_id, []).append(turn)
        self.inner.record_turn(turn)

    def finish_episode(self, episode: EpisodeRecord) -> None:
        with self._lock:
            turns = self._turns.pop(episode.episode_id, [])
        episode.token_ids_status = assemble(turns).status if turns else None
        if self.cancelled(episode.episode_id) and episode.termination in INFRA_TERMINATIONS:
            episode.error = f"cancelled: the trainer disconnected ({episode.error or 'no error'})"
            episode.termination = "interrupted"
        self.inner.finish_episode(episode)

    def __getattr__(self, name: str) -> Any:  # close(), abandon() ... of the inner recorder
        return getattr(self.inner, name)
