"""Tree rollouts from the rollout server (issue #25), over real HTTP, with real sandboxes,
the real engine and a real warehouse: a scripted policy with vLLM-style token ids.

Each sample's episode branches at turn 1 into 3 siblings (forked sandboxes). Checked: the
leaves and their lineage, the shared prefix (messages and token ids) identical across
siblings, the state the branches inherited (a file, a variable, the cwd), the task
group's advantages over every leaf and each branch point's advantages among siblings.
Then: siblings run at once within the server's and the batch's bounds (seen by the scripted
server), and a budget reached mid-tree stops the leaves left.
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


class InFlight:
    """What the scripted server sees at once. After the first turn, each request is held
    until `target` requests of its wave (the same turn) have arrived, or `hold_s` passed
    (the bounds then allow fewer), so the most requests in flight together is what the
    server allowed, not a matter of timing."""

    def __init__(self, target: int, hold_s: float) -> None:
        self.target, self.hold_s = target, hold_s
        self.now = self.peak = 0
        self.arrived: dict[int, int] = {}
        self.cond = threading.Condition()

    def wrap(self, policy: Any) -> Any:
        def reply(body: dict, index: int) -> Any:
            wave = sum(1 for m in body["messages"] if m.get("role") == "assistant")
            if wave == 0:
                return policy(body, index)  # the root's first turn: alone by nature
            with self.cond:
                self.now += 1
                self.peak = max(self.peak, self.now)
                self.arrived[wave] = self.arrived.get(wave, 0) + 1
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.arrived[wave] >= self.target, timeout=self.hold_s)
            try:
                return policy(body, index)
            finally:
                with self.cond:
                    self.now -= 1

        return reply


@pytest.mark.parametrize(  # 3 sandboxes per case: 1-4 s
    ("server_limit", "batch_limit", "peak"),
    [(8, None, 3), (2, None, 2), (8, 2, 2)],
    ids=["siblings-at-once", "server-bound", "batch-bound"],
)
def test_siblings_run_at_once_within_the_bounds(
    tmp_path: Path, server_limit: int, batch_limit: int | None, peak: int
) -> None:
    """A width-3 tree: its 3 siblings' requests reach the scripted server together when the
    bounds allow 3; with a bound of 2 (the server's, or the batch's own) never more than 2
    episodes run and call the model at once, and every leaf still ends."""
    run_id = new_run_id("tree-at-once")
    digits = itertools.cycle(["1", "2", "1"])
    # held until 3 are in flight: reached when allowed; else each held 1 s, then goes on
    seen = InFlight(3, hold_s=60.0 if peak == 3 else 1.0)
    extra = {"max_concurrency": batch_limit} if batch_limit else {}
    with (
        rollout_server(tmp_path / "wh", max_concurrency=server_limit) as (url, _),
        ScriptedModel(default=seen.wrap(branching_policy(digits))) as model,
        RolloutClient(url) as client,
    ):
        result = client.rollouts(
            request(model, run_id, n=1, branching={"width": 3, "at_turns": [1]}, **extra)
        )
    assert seen.peak == peak, (seen.peak, peak)
    assert result.summary["peak_concurrent"] == peak, result.summary
    assert result.summary["ok"] == 3 and len(model.requests) == 1 + 3 * 2, [
        (t["status"], t["termination"], t.get("error")) for t in result.trajectories
    ]
    assert sorted(t["reward"] for t in result.trajectories) == [0.0, 0.0, 1.0]
    (point,) = result.branch_points
    assert len(point["siblings"]) == 3 and sorted(point["values"]) == [0.0, 0.0, 1.0]


def test_a_budget_reached_mid_tree_stops_the_leaves_left(tmp_path: Path) -> None:
    """Width 2 at turn 1, every reply 1,000 tokens, a budget of 3,000. The siblings run at
    once: the first to ask for turn 1 (X) writes 42 and submits; the other's turn 1 (Y) is
    answered only once X has asked for its last turn. Y's turn brings the spend to 3,000
    as it lands, so Y stops before asking again: the trainer gets X with its reward and Y
    `cancelled` / `budget_exhausted` with no reward (counted when the tree ended, as
    before, Y would have gone on and submitted)."""
    from tests.rl.conftest import status_of
    from tests.rl.test_budget import _events
    from warehouse.cost import token_sums
    from warehouse.query import connect

    wh, run_id = tmp_path / "wh", new_run_id("tree-budget")
    usage = {"prompt_tokens": 1000, "completion_tokens": 0, "total_tokens": 1000}
    lock, x_asked_last = threading.Lock(), threading.Event()
    firsts: list[int] = []

    def policy(body: dict, index: int) -> Reply:
        done = sum(1 for m in body["messages"] if m.get("role") == "assistant")
        if done == 0:
            reply = tool_reply("execute_bash", {"command": SHAPE})
        elif done == 1:
            with lock:
                firsts.append(index)
                second = len(firsts) > 1
            if second:  # Y: after X asked for its last turn (X cannot be stopped any more)
                assert x_asked_last.wait(120), "the siblings did not run at once"
            cmd = f"echo {41 if second else 42} > answer.txt"
            reply = tool_reply("execute_bash", {"command": cmd})
        else:
            x_asked_last.set()
            reply = tool_reply("submit", {})
        reply.usage = dict(usage)
        return reply

    with (
        rollout_server(wh) as (url, _),
        ScriptedModel(default=policy, models=("scripted",)) as model,
    ):
        body = request(
            model, run_id, n=1, branching={"width": 2, "at_turns": [1]},
            budget={"max_run_tokens": 3000},
        )  # fmt: skip
        events = _events(url, body)
    assert len(model.requests) == 4  # root's turn 0, X's turns 1-2, Y's turn 1
    leaves = [e for e in events if e["type"] == "trajectory"]
    ok = [t for t in leaves if t["status"] == "ok"]
    stopped = [t for t in leaves if t["status"] == "cancelled"]
    assert len(ok) == 1 and ok[0]["reward"] == 1.0 and ok[0]["termination"] == "submitted"
    assert len(stopped) == 1 and stopped[0]["termination"] == "budget_exhausted"
    assert stopped[0]["reward"] is None and "--max-run-tokens 3000" in stopped[0]["reason"]
    (point,) = [e for e in events if e["type"] == "branch_point"]
    assert sorted(point["values"], key=lambda v: v is None) == [1.0, None]
    done = events[-1]
    assert done["stopped"] == "budget_exhausted" and (done["ok"], done["cancelled"]) == (1, 1)
    assert status_of(wh, run_id) == "budget_exhausted"
    terms = sorted((e["termination"], e["num_turns"]) for e in read_episodes(wh, run_id))
    assert terms == [("budget_exhausted", 2), ("submitted", 3)]
    # what the run spent: 4 replies; Y's copy of the root's turn 0 is not paid twice
    assert done["budget"]["spent_tokens"] == 4000
    with connect(wh) as q:
        assert token_sums(q, run_id)[0] == 4000
