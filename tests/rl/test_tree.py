"""Tree rollouts from the rollout server (issue #25), over real HTTP, with real sandboxes,
the real engine and a real warehouse: a scripted policy with vLLM-style token ids.

Each sample's episode branches at turn 1 into 3 siblings (forked sandboxes). Checked: the
leaves and their lineage, the shared prefix (messages and token ids) identical across
siblings, the state the branches inherited (a file, a variable, the cwd), the task
group's advantages over every leaf and each branch point's advantages among siblings.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path
from typing import Any

import pytest

from rl.client import RolloutClient
from tests.rl.conftest import new_run_id, read_episodes, rollout_server
from tests.rl.test_server import check_tokens, request
from tests.scripted_model import Reply, ScriptedModel, ToyTokenizer, tool_reply

SHAPE = "echo 4 > /tmp/part; export HALF=x; cd /testbed/output"


def branching_policy(digits: Any) -> Any:
    """Turn 0 leaves state; turn 1 answers 4<next digit> from that state; turn 2 submits."""
    lock = threading.Lock()

    def reply(body: dict, index: int) -> Reply:
        done = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        if done == 0:
            return tool_reply("execute_bash", {"command": SHAPE}, content="Setting up.")
        if done == 1:
            with lock:
                d = next(digits)
            cmd = f'[ "$PWD$HALF" = /testbed/outputx ] && echo $(cat /tmp/part){d} > answer.txt'
            return tool_reply("execute_bash", {"command": cmd})
        return tool_reply("submit", {})

    return reply


@pytest.mark.slow  # 8 sandboxes, ~15 s
def test_a_tree_from_the_server_shares_its_prefix_and_has_branch_advantages(
    tmp_path: Path,
) -> None:
    tok = ToyTokenizer()
    run_id = new_run_id("tree")
    digits = itertools.cycle(["1", "2", "1"])  # one tree at a time: its 2nd leaf is right
    branching = {"width": 3, "at_turns": [1]}
    with (
        rollout_server(tmp_path / "wh") as (url, _),
        ScriptedModel(default=branching_policy(digits), tokenizer=tok) as model,
        RolloutClient(url) as client,
    ):
        body = request(model, run_id, n=2, branching=branching, max_concurrency=1)
        result = client.rollouts(body)
        # and the other rule: after the first tool-call turn, width 2
        run2 = new_run_id("tree-tools")
        body2 = request(model, run2, n=1, branching={"width": 2, "after_tool_calls": 1})
        result2 = client.rollouts(body2)
    assert result.summary["episodes"] == 6 and result.summary["ok"] == 6, result.summary
    leaves = result.trajectories
    roots = [t for t in leaves if t["parent_episode_id"] is None]
    assert len(roots) == 2
    for root in roots:
        tree = [t for t in leaves if t["tree_root"] == root["episode_id"]]
        kids = [t for t in tree if t is not root]
        assert len(tree) == 3
        assert {(t["parent_episode_id"], t["branch_turn"], t["branch_kind"]) for t in kids} == {
            (root["episode_id"], 1, "fork")
        }
        assert all(t["branch_path"] == [[root["episode_id"], 1]] for t in tree)
        # the shared prefix: same messages, same token ids, up to the branch turn
        assert len({repr(t["messages"][:4]) for t in tree}) == 1
        prefix = len(tok.render(root["messages"][:4])) - len(root["prompt_ids"])
        assert prefix > 0
        assert len({(tuple(t["prompt_ids"]), tuple(t["response_ids"][:prefix])) for t in tree}) == 1
        for t in tree:
            check_tokens(t, tok)
            assert t["num_turns"] == 3 and t["termination"] == "submitted"
        # the 2nd leaf (the first new branch) wrote 42 from the state it inherited
        by_index = sorted(tree, key=lambda t: t["sample_index"])
        assert [t["reward"] for t in by_index] == [0.0, 1.0, 0.0]
        (point,) = [p for p in result.branch_points if p["tree_root"] == root["episode_id"]]
        assert point["siblings"] == [t["episode_id"] for t in by_index]
        assert point["values"] == [0.0, 1.0, 0.0]
        assert point["advantage_rloo"] == [-0.5, 1.0, -0.5]
        assert [round(a, 3) for a in point["advantage_grpo"]] == [-0.577, 1.155, -0.577]
        for t, a in zip(by_index, point["advantage_rloo"], strict=True):
            assert t["branch_advantages"][0]["advantage_rloo"] == a
    # the task's group: every leaf of both trees
    (group,) = result.groups
    assert group["size"] == 6 and sorted(group["rewards"]) == [0.0] * 4 + [1.0] * 2
    assert round(max(t["advantage_rloo"] for t in leaves), 4) == round(1 - 1 / 5, 4)
    rows = {e["episode_id"]: e for e in read_episodes(tmp_path / "wh", run_id)}
    assert set(rows) == {t["episode_id"] for t in leaves}
    assert sum(1 for e in rows.values() if e["branch_kind"] == "fork") == 4
    # after_tool_calls=1: one branch point, after turn 0 (the first turn that ran a tool)
    assert result2.summary["ok"] == 2
    (p2,) = result2.branch_points
    assert p2["branch_turn"] == 1 and len(p2["siblings"]) == 2


def test_grow_in_pooled_sandboxes_with_the_episodes_own_model() -> None:
    """rl.tree.grow without the server: the episode calls its own endpoint (each branch
    its own client: the root's closes when the root ends first), and the branches' sandboxes
    are leases from the warm pool (PooledSandbox.fork), opened while the root runs on."""
    from rl.tree import BranchSpec, grow
    from sandbox.base import SandboxConfig, SandboxLimits
    from sandbox.pool import pool_for
    from tasks.loop import Limits, SteppedEpisode
    from tasks.model import ModelConfig
    from tests.rl.conftest import math_task

    digits = itertools.cycle(["2", "1"])
    # a pool of its own (its key: the limits), closed at the end: no other test gets its sandboxes
    cfg = SandboxConfig(reuse="pool", limits=SandboxLimits(network="none", memory_mb=448))
    with ScriptedModel(default=branching_policy(digits)) as model, contextlib.closing(
        pool_for(cfg)
    ):
        root = SteppedEpisode(
            math_task(),
            cfg,
            model_cfg=ModelConfig(model="scripted", base_url=model.url, max_retries=0),
            run_id=new_run_id("grow"),
            limits=Limits(max_steps=5, wall_clock_s=120),
        )
        root.start()
        assert type(root.sandbox).__name__ == "PooledSandbox"
        leaves = grow(root, BranchSpec(width=2, at_turns=[1]), itertools.count(1).__next__)
    assert [b.episode.record.termination for b in leaves] == ["submitted", "submitted"]
    assert [b.episode.record.answer for b in leaves] == ["42", "41"]
    assert leaves[1].parent == root.record.episode_id and leaves[1].branch_turn == 1
