"""Group advantages as soon as a task's samples are all in (GRPO and RLOO).

The definitions are the exported rollouts' own (analysis/advantages.py):
GRPO  A_i = (r_i - mean r) / (std r + eps), std with n-1 (as verl);
RLOO  A_i = r_i - mean_{j != i} r_j.
A group's baseline is over the samples that have a reward: an infrastructure failure
(or an ungradable task) is left out, never counted as 0; one sample alone gets 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from analysis.advantages import EPS, grpo, rloo

__all__ = ["EPS", "Group", "grpo", "rloo"]


@dataclass
class Group:
    """The samples of one task in one batch."""

    task_id: str
    expected: int
    episode_ids: list[str] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)

    def add(self, episode_id: str, reward: float | None) -> bool:
        """Record a finished sample; True when this completes the group."""
        self.episode_ids.append(episode_id)
        self.rewards.append(reward)
        return len(self.episode_ids) == self.expected

    def advantages(self) -> dict[str, object]:
        scored = [
            (e, r) for e, r in zip(self.episode_ids, self.rewards, strict=True) if r is not None
        ]
        rewards = [r for _, r in scored]
        g, lo = grpo(rewards), rloo(rewards)
        return {
            "task_id": self.task_id,
            "size": len(scored),
            "failed": len(self.episode_ids) - len(scored),
            "episode_ids": [e for e, _ in scored],
            "rewards": rewards,
            "advantage_grpo": g,
            "advantage_rloo": lo,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        }
