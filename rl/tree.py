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

Siblings run at once, within a bound on running episodes (`slots`: the rollout server's
and the batch's, rl.slots): at a branch point each new sibling that gets a slot runs on
a thread of its own; one that gets none waits (its sandbox open, its wall clock stopped)
for the next of its tree's threads to be free, depth first. Without `slots` the whole
tree runs in the calling thread, one episode after another. With `at_turns` on Docker,
the sandboxes of an episode's next branch point are opened in another thread while the
episode runs up to it (a branch point then costs the copy, not the starts).
`max_leaves` bounds the episodes, and so the sandboxes, of one tree: a branch point past
it is skipped (the episode goes on without branching), and so is every branch point once
the episodes' cancel token is set (a budget reached: what is left stops at its next
step). Values and advantages per branch point: `branch_points`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    ended: threading.Event = field(default_factory=threading.Event)  # finished and recorded


class TreeSlots(Protocol):
    """What `grow` needs of a bound on running episodes (rl.slots.Slots has it)."""

    def try_take(self) -> bool: ...

    def give(self) -> None: ...


def grow(
    root: SteppedEpisode,
    spec: BranchSpec,
    next_index: Callable[[], int],
    *,
    slots: TreeSlots | None = None,
    on_turn: Callable[[SteppedEpisode, int], None] | None = None,
    on_end: Callable[[SteppedEpisode], None] | None = None,
) -> list[Branch]:
    """Drive `root` (started) and every branch it makes to their ends, with the episode's
    own model (SteppedEpisode.generate). Returns every episode, finished, in the order
    they ended. A fork that fails leaves the episode unbranched (noted in its record's
    config, `fork_error`); it is not an infrastructure failure of the episode.

    slots: None runs the tree in this thread, depth first. Given, the calling thread
        holds one slot for the root (taken by the caller); `grow` gives it back when this
        thread has no more of the tree's work, and each sibling made at a branch point
        runs at once on a thread of its own when `slots.try_take()` gives it a slot
        (given back when that thread is done), else it waits, forked, for the next of
        its tree's threads to be free. So the tree never runs more episodes at once than
        the slots allow, and never waits for a slot while it holds one (no deadlock).
    on_turn(episode, turns_before): after each step (a budget counts the turns it added).
    on_end(episode): after a branch ended and was recorded.
    No branch point forks once the episode's cancel token is set (a budget was reached,
    the trainer went away): the episodes left stop at their next step."""
    tree = _Tree(spec, next_index, slots, on_turn, on_end)
    try:
        tree.work(Branch(root), holds_slot=slots is not None)
    finally:
        tree.join()
    if tree.error is not None:
        raise tree.error
    return tree.done


class _Tree:
    """One tree's shared state: its episode count (max_leaves), the siblings waiting for
    a thread (forked, sandbox open, clock stopped), its finished leaves and its threads.

    A thread's loop: drive a branch to its end (forking at its branch points), then take
    the next waiting one, until none waits. A sibling is only ever left waiting by a
    thread that is running, and that thread takes waiting ones before it ends, so none
    is forgotten. A thread ends only after every episode whose sandboxes it opened has
    ended: a bwrap sandbox dies with the thread that started it (--die-with-parent)."""

    def __init__(
        self,
        spec: BranchSpec,
        next_index: Callable[[], int],
        slots: TreeSlots | None,
        on_turn: Callable[[SteppedEpisode, int], None] | None,
        on_end: Callable[[SteppedEpisode], None] | None,
    ) -> None:
        self.spec, self.slots = spec, slots
        self._next_index, self.on_turn, self.on_end = next_index, on_turn, on_end
        self.lock = threading.Lock()
        self.count = 1
        self.waiting: list[Branch] = []  # popped last-in first: depth first, siblings in order
        self.done: list[Branch] = []
        self.threads: list[threading.Thread] = []
        self.own: dict[int, list[Branch]] = {}  # thread -> the branches whose sandboxes it opened
        self.error: BaseException | None = None

    # -- the tree's bookkeeping (any thread) ----------------------------------------------
    def reserve(self, n: int) -> list[int] | None:
        """n new episodes' sample indices, or None past max_leaves."""
        with self.lock:
            if self.count + n > self.spec.max_leaves:
                return None
            self.count += n
            return [self._next_index() for _ in range(n)]

    def unreserve(self, n: int) -> None:
        with self.lock:
            self.count -= n

    def offer(self, kids: list[Branch]) -> None:
        """Siblings just forked: each on a thread of its own when a slot is free, else
        waiting for one of the tree's threads (taken in sample order)."""
        self.own[threading.get_ident()].extend(kids)
        wait = []
        for kid in kids:
            if self.slots is not None and self.error is None and self.slots.try_take():
                t = threading.Thread(
                    target=self._thread, args=(kid,), name="sandflow-tree-branch", daemon=True
                )
                with self.lock:
                    self.threads.append(t)
                t.start()
            else:
                wait.append(kid)
        with self.lock:
            self.waiting.extend(reversed(wait))

    def _pop(self) -> Branch | None:
        with self.lock:
            return self.waiting.pop() if self.waiting and self.error is None else None

    # -- one thread's work ----------------------------------------------------------------
    def _thread(self, first: Branch) -> None:
        self.work(first, holds_slot=True)

    def work(self, first: Branch, holds_slot: bool) -> None:
        """Drive `first`, then waiting siblings, to their ends; give the slot back; wait
        until the episodes whose sandboxes this thread opened have ended."""
        self.own[threading.get_ident()] = []
        ahead = _Ahead(first.episode, self)
        b: Branch | None = first
        try:
            while b is not None:
                self._drive(b, ahead)
                b = self._pop()
        except BaseException as exc:  # a bug or the recorder failed: stop the tree
            with self.lock:
                self.error = self.error or exc
            if b is not None:
                self._end(b, failed=True)
        finally:
            ahead.close()
            if holds_slot and self.slots is not None:
                self.slots.give()
            if self.error is not None:
                self.drain()
            for kid in self.own.pop(threading.get_ident(), []):
                kid.ended.wait()

    def _drive(self, b: Branch, ahead: _Ahead) -> None:
        ep = b.episode
        if b.forked_at:
            ep.shift_clock(time.monotonic() - b.forked_at)
        ahead.start(b)
        while not ep.done:
            t = len(ep.turns)
            if self._forks_here(b, t, ahead):
                self._fork(b, t, ahead)
                ahead.start(b)
            reply = ep.generate()
            if reply is None:
                break
            before = len(ep.turns)
            ep.step(reply)
            if self.on_turn is not None:
                self.on_turn(ep, before)
        self.unreserve(ahead.drop())
        self._end(b)

    def _forks_here(self, b: Branch, t: int, ahead: _Ahead) -> bool:
        cancel = b.episode.cancel
        if cancel is not None and cancel.is_set():
            return False
        return _branches_here(self.spec, b, t) and (
            ahead.ready(t) or self.count + self.spec.width - 1 <= self.spec.max_leaves
        )

    def _fork(self, b: Branch, t: int, ahead: _Ahead) -> None:
        ep = b.episode
        b.points += 1
        b.from_turn = t
        kids: list[SteppedEpisode] = []
        try:
            indices, boxes = ahead.take(t)
            if not indices:
                indices = self.reserve(self.spec.width - 1) or []
            if indices:
                kids = ep.fork(indices, boxes)
        except SandboxError as exc:
            b.fork_error = f"turn {t}: {exc}"[:500]
            ep.record.config["fork_error"] = b.fork_error
        now = time.monotonic()
        path = [*b.path, (ep.record.episode_id, t)]
        b.path = path
        self.offer(
            [Branch(kid, ep.record.episode_id, t, path, b.points, t, forked_at=now) for kid in kids]
        )

    def _end(self, b: Branch, failed: bool = False) -> None:
        try:
            if failed:
                with contextlib.suppress(Exception):
                    b.episode.finish("interrupted", "the tree stopped on an error")
            else:
                b.episode.finish()
                if self.on_end is not None:
                    self.on_end(b.episode)
            with self.lock:
                self.done.append(b)
        finally:
            b.ended.set()

    def join(self) -> None:
        """Wait for the tree's threads; siblings still waiting after an error are ended."""
        while True:
            with self.lock:
                threads = [t for t in self.threads if t.is_alive()]
            if not threads:
                break
            for t in threads:
                t.join()
        self.drain()

    def drain(self) -> None:
        """End the siblings still waiting (the tree stopped on an error): their sandboxes
        closed, recorded interrupted."""
        with self.lock:
            left, self.waiting = self.waiting, []
        for b in left:
            self._end(b, failed=True)


class _Ahead:
    """The sandboxes of an episode's next branch point (at_turns), opened in another thread
    while the episode runs up to it, so the branch point costs the copy only. Docker only
    (a bwrap sandbox lives as long as the thread that started it); sandboxes opened for a
    branch point that does not come (the episode ended first) are closed. One per tree
    thread."""

    def __init__(self, root: SteppedEpisode, tree: _Tree) -> None:
        self.spec, self.tree = tree.spec, tree
        box = root.sandbox
        self.on = bool(self.spec.at_turns) and box is not None and box.capabilities.parallel_open
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sandflow-tree") if self.on else None
        self.turn: int | None = None
        self.indices: list[int] = []
        self.future: Future[list[Any]] | None = None

    def start(self, b: Branch) -> None:
        """Open the sandboxes of `b`'s next branch point when max_leaves allows (reserved)."""
        if self.pool is None or self.future is not None:
            return
        cancel = b.episode.cancel
        if cancel is not None and cancel.is_set():
            return
        later = [t for t in self.spec.at_turns if t > b.from_turn]
        if not later:
            return
        indices = self.tree.reserve(self.spec.width - 1)
        if indices is None:
            return
        self.turn, self.indices = later[0], indices
        self.future = self.pool.submit(b.episode.open_branches, self.indices)

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
        self.tree.unreserve(self.drop())
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
