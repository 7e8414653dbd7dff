"""Tree rollouts: an episode that branches into k continuations at chosen turns (issue #25).

RL methods that branch at tool-call steps sample k continuations from the state after a
tool call and compare the siblings. Here a branch point forks the episode's live sandbox
(sandbox.fork: files and shell state) and its history (tasks.loop.SteppedEpisode.fork):
the episode that branches goes on as one of the k siblings and k-1 new episodes continue
from the same turn, each recorded with its lineage (parent episode, branch turn, "fork").
Every episode of a tree is a leaf: a whole trajectory whose turns before its branch
turn are its parent's, token ids included.

    BranchSpec(width=4, at_turns=[3])            # before the model's turn 3: 4 siblings
    BranchSpec(width=2, after_tool_calls=2)      # after each of the first 2 tool-call turns

A tree runs in one worker thread, depth first: a branch waits (its sandbox open, its
wall clock stopped) until the episode before it ends. With `at_turns` on Docker, the
sandboxes of an episode's next branch point are opened in another thread while the
episode runs up to it (a branch point then costs the copy, not the starts). `max_leaves` bounds the episodes,
and so the sandboxes, of one tree: a branch point past it is skipped (the episode goes
on without branching). Values and advantages per branch point: `branch_points`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from analysis.advantages import grpo, rloo
from sandbox.base import SandboxError
from tasks.loop import SteppedEpisode


class BranchSpec(BaseModel):
    """Where the episodes of a rollout request branch (RolloutRequest.branching)."""

    model_config = ConfigDict(extra="forbid")

    width: int = Field(
        2, ge=2, le=16, description="siblings per branch point (the branching episode is one)"
    )
    at_turns: list[int] = Field(
        default_factory=list,
        description="branch before the model's turn t (t >= 1: after turn t-1's tool calls)",
    )
    after_tool_calls: int | None = Field(
        None, ge=1, le=8, description="or: after each turn that ran tools, this many per path"
    )
    max_leaves: int = Field(16, ge=2, le=256, description="episodes per tree at most")

    @model_validator(mode="after")
    def _one_rule(self) -> BranchSpec:
        if bool(self.at_turns) == (self.after_tool_calls is not None):
            raise ValueError("branching: give either at_turns or after_tool_calls (one of them)")
        if any(t < 1 for t in self.at_turns):
            raise ValueError("branching.at_turns: turns start at 1 (turn 0 has no state yet)")
        self.at_turns = sorted(set(self.at_turns))
        return self


@dataclass
class Branch:
    """An episode of a tree with where it came from (root: parent None)."""

    episode: SteppedEpisode
    parent: str | None = None  # the episode it branched from
    branch_turn: int | None = None
    path: list[tuple[str, int]] = field(default_factory=list)  # (parent episode, turn), root first
    points: int = 0  # branch points this episode's path has made (after_tool_calls' budget)
    from_turn: int = 0  # it branches only at later turns than this
    forked_at: float = 0.0  # monotonic time of its fork (its wait is not its own time)
    fork_error: str | None = None  # a branch point that could not fork, on this episode


def grow(
    root: SteppedEpisode, spec: BranchSpec, next_index: Callable[[], int]
) -> list[Branch]:
    """Drive `root` (started) and every branch it makes to their ends, depth first, with
    the episode's own model (SteppedEpisode.generate). Returns every episode, finished,
    in the order they ended. A fork that fails leaves the episode unbranched (noted in its
    record's config, `fork_error`); it is not an infrastructure failure of the episode."""
    stack = [Branch(root)]
    done: list[Branch] = []
    try:
        _grow(stack, done, spec, next_index)
    except BaseException:  # a bug or the recorder failed: no waiting branch keeps a sandbox
        for b in stack:
            with contextlib.suppress(Exception):
                b.episode.finish("interrupted", "the tree stopped on an error")
        raise
    return done


def _grow(
    stack: list[Branch], done: list[Branch], spec: BranchSpec, next_index: Callable[[], int]
) -> None:
    count = 1
    ahead = _Ahead(stack[0].episode, spec)
    try:
        while stack:
            b = stack.pop()
            ep = b.episode
            if b.forked_at:
                ep.shift_clock(time.monotonic() - b.forked_at)
            count = ahead.start(b, count, next_index)
            while not ep.done:
                t = len(ep.turns)
                if _branches_here(spec, b, t) and (
                    ahead.ready(t) or count + spec.width - 1 <= spec.max_leaves
                ):
                    b.points += 1
                    b.from_turn = t
                    try:
                        indices, boxes = ahead.take(t)
                        if not indices:
                            indices = [next_index() for _ in range(spec.width - 1)]
                            count += len(indices)
                        kids = ep.fork(indices, boxes)
                    except SandboxError as exc:
                        b.fork_error = f"turn {t}: {exc}"[:500]
                        ep.record.config["fork_error"] = b.fork_error
                        kids = []
                    now = time.monotonic()
                    path = [*b.path, (ep.record.episode_id, t)]
                    for kid in reversed(kids):  # popped in sample order
                        stack.append(
                            Branch(kid, ep.record.episode_id, t, path, b.points, t, forked_at=now)
                        )
                    b.path = path
                    count = ahead.start(b, count, next_index)
                reply = ep.generate()
                if reply is None:
                    break
                ep.step(reply)
            count -= ahead.drop()
            ep.finish()
            done.append(b)
    finally:
        ahead.close()


class _Ahead:
    """The sandboxes of an episode's next branch point (at_turns), opened in another thread
    while the episode runs up to it, so the branch point costs the copy only. Docker only
    (a bwrap sandbox lives as long as the thread that started it); sandboxes opened for a
    branch point that does not come (the episode ended first) are closed."""

    def __init__(self, root: SteppedEpisode, spec: BranchSpec) -> None:
        self.spec = spec
        self.on = bool(spec.at_turns) and getattr(root.sandbox, "backend", None) == "docker"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sandflow-tree") if self.on else None
        self.turn: int | None = None
        self.indices: list[int] = []
        self.future: Future[list[Any]] | None = None

    def start(self, b: Branch, count: int, next_index: Callable[[], int]) -> int:
        """Open the sandboxes of `b`'s next branch point when the budget allows; the
        episode count with them reserved."""
        if self.pool is None or self.future is not None:
            return count
        later = [t for t in self.spec.at_turns if t > b.from_turn]
        if not later or count + self.spec.width - 1 > self.spec.max_leaves:
            return count
        self.turn = later[0]
        self.indices = [next_index() for _ in range(self.spec.width - 1)]
        self.future = self.pool.submit(b.episode.open_branches, self.indices)
        return count + len(self.indices)

    def ready(self, turn: int) -> bool:
        return self.future is not None and self.turn == turn

    def take(self, turn: int) -> tuple[list[int], list[Any] | None]:
        """(indices, sandboxes) opened for `turn`, or ([], None); SandboxError as opening."""
        if not self.ready(turn):
            return [], None
        assert self.future is not None
        future, indices, self.future, self.turn = self.future, self.indices, None, None
        return indices, future.result()

    def drop(self) -> int:
        """Close what was opened for a branch point that did not come; how many."""
        if self.future is None:
            return 0
        future, n, self.future, self.turn = self.future, len(self.indices), None, None
        with contextlib.suppress(Exception):
            for box in future.result():
                with contextlib.suppress(Exception):
                    box.close()
        return n

    def close(self) -> None:
        self.drop()
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _branches_here(spec: BranchSpec, b: Branch, turn: int) -> bool:
    if turn <= b.from_turn:
        return False
    if spec.at_turns:
        return turn in spec.at_turns
    assert spec.after_tool_calls is not None
    turns = b.episode.turns
    return bool(turns and turns[-1].tool_calls) and b.points < spec.after_tool_calls


def branch_points(
    branches: list[Branch], rewards: dict[str, float | None]
) -> list[dict[str, Any]]:
    """Per branch point of a tree: its siblings (the episode that branched, then the new
    ones), the leaves under each, each sibling's value (the mean reward of its leaves that
    have one) and the GRPO/RLOO advantages of those values among the siblings. A sibling
    with no scored leaf is left out of the baseline (never counted as 0)."""
    kids: dict[tuple[str, int], list[str]] = {}
    order = {b.episode.record.episode_id: b.episode.record.sample_index for b in branches}
    for b in sorted(branches, key=lambda b: b.episode.record.sample_index):
        if b.parent is not None and b.branch_turn is not None:
            kids.setdefault((b.parent, b.branch_turn), []).append(b.episode.record.episode_id)
    below: dict[str, list[tuple[int, str]]] = {}  # episode -> (branch turn, child) it made
    for (parent, turn), ids in kids.items():
        below.setdefault(parent, []).extend((turn, c) for c in ids)

    def leaves(episode: str, after: int) -> list[str]:
        out = [episode]
        for turn, child in below.get(episode, []):
            if turn > after:
                out += leaves(child, -1)
        return out

    points = []
    for (parent, turn), ids in sorted(kids.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])):
        heads = [parent, *ids]  # the new ones in sample order
        under = [leaves(parent, turn), *(leaves(c, -1) for c in ids)]
        values = [_mean([rewards.get(e) for e in group]) for group in under]
        scored = [v for v in values if v is not None]
        g, lo = iter(grpo(scored)), iter(rloo(scored))
        points.append(
            {
                "parent_episode_id": parent,
                "branch_turn": turn,
                "siblings": heads,
                "leaves": under,
                "values": values,
                "advantage_grpo": [next(g) if v is not None else None for v in values],
                "advantage_rloo": [next(lo) if v is not None else None for v in values],
            }
        )
    return points


def _mean(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return sum(got) / len(got) if got else None
