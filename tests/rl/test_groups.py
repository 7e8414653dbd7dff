"""Group advantages: the server's live ones equal the exported rollouts' definitions."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rl.groups import Group, grpo, rloo


def _reference() -> Any:
    """The exported rollouts' module (flows/ today, analysis/ after issue #12)."""
    import importlib

    for name in ("analysis.advantages", "flows.advantages"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise AssertionError("no advantages module to compare with")


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_same_numbers_as_the_exported_rollouts(n: int) -> None:
    ref = _reference()
    rng = random.Random(n)
    for _ in range(20):
        rewards = [rng.choice([0.0, 0.25, 1.0]) for _ in range(n)]
        assert grpo(rewards) == pytest.approx(ref.grpo(rewards))
        assert rloo(rewards) == pytest.approx(ref.rloo(rewards))


def test_a_group_leaves_out_samples_without_reward() -> None:
    g = Group("t", expected=4)
    assert not g.add("a", 1.0)
    assert not g.add("b", None)  # an infrastructure failure: not a zero
    assert not g.add("c", 0.0)
    assert g.add("d", 1.0)
    adv = g.advantages()
    assert adv["episode_ids"] == ["a", "c", "d"] and adv["size"] == 3 and adv["failed"] == 1
    assert adv["advantage_rloo"] == pytest.approx([0.5, -1.0, 0.5])
    assert adv["reward_mean"] == pytest.approx(2 / 3)
