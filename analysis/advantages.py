"""Group-normalised advantages over the samples of one task (GRPO and RLOO).

The paper trains with RLOO over 8 rollouts per task; GRPO is the other common
choice. Both compare a sample's reward with the other samples of the SAME task
(the group), so they need no value model:

- GRPO:  A_i = (r_i - mean(r)) / (std(r) + eps)        (std: sample std, n-1, as verl)
- RLOO:  A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean(r))

A group of one sample has no baseline: its advantage is 0 under both (it carries
no learning signal, and exporting it as 0 keeps the row for inspection).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence

EPS = 1e-6


def grpo(rewards: Sequence[float], eps: float = EPS) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def group_advantages(
    keys: Sequence[Hashable], rewards: Sequence[float], method: str = "rloo"
) -> list[float]:
    """Advantages for rows whose group is `keys[i]` (e.g. (task_id, mode))."""
    if len(keys) != len(rewards):
        raise ValueError(f"{len(keys)} group keys but {len(rewards)} rewards")
    fn = {"grpo": grpo, "rloo": rloo}.get(method)
    if fn is None:
        raise ValueError(f"unknown advantage method {method!r}: use 'grpo' or 'rloo'")
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    out = [0.0] * len(rewards)
    for idx in groups.values():
        for i, a in zip(idx, fn([rewards[i] for i in idx]), strict=True):
            out[i] = a
    return out
