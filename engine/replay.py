"""`sandflow run --replay RUN/EPISODE --until-turn K`: a recorded episode, rebuilt to turn K
in a fresh sandbox and continued by a model (tasks.replay), recorded as a new episode of a
run of its own in the same warehouse with its lineage (parent, branch turn, "replay").

This module finds what the replay needs in the warehouse: the parent episode and its turns
(`Warehouse.episode`) and the exact task the parent's run ran (`Warehouse.run_tasks`: a
task's input files are part of the state). The episode itself runs through
engine.single.run_single, like any `sandflow run`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from datasets_prep.task import Task
from tasks.records import EpisodeRecord, TurnRecord
from tasks.replay import ReplayError, check_prefix, compile_ignore

_SOURCE_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})/([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")


@dataclass
class ReplayPlan:
    """A parent episode found in the warehouse, its task, and how to replay it."""

    task: Task
    parent: EpisodeRecord
    turns: list[TurnRecord]
    until_turn: int
    ignore: tuple[str, ...] = ()
    allow_divergence: bool = False
    notes: list[str] = field(default_factory=list)


def parse_source(text: str) -> tuple[str, str]:
    """"RUN/EPISODE" -> (run id, episode id); ReplayError saying the expected form."""
    m = _SOURCE_RE.match(text.strip())
    if m is None:
        raise ReplayError(
            f"--replay {text[:120]!r} is not RUN/EPISODE (a run id and an episode id, e.g. "
            "run-20261126-063000-123/3f2a...; `sandflow sql \"SELECT run_id, episode_id FROM "
            "episodes\"` lists them)"
        )
    return m.group(1), m.group(2)


def plan_replay(
    root: Path | str,
    source: str,
    until_turn: int,
    *,
    ignore: tuple[str, ...] = (),
    allow_divergence: bool = False,
) -> ReplayPlan:
    """Everything checked before any sandbox starts: the source's form, the episode, its
    turns up to `until_turn`, its run's recorded task, the ignore patterns. ReplayError
    (one sentence naming what is wrong) otherwise."""
    from warehouse import Warehouse, WarehouseError

    run_id, episode_id = parse_source(source)
    compile_ignore(ignore)
    wh = Warehouse(root)
    try:
        found = wh.episode(run_id, episode_id)
    except WarehouseError as exc:
        raise ReplayError(f"--replay {source}: {exc}") from None
    if found is None:
        raise ReplayError(f"--replay {source}: warehouse {root} has no episode {episode_id} in run {run_id}")
    parent, turns = found
    check_prefix(parent, turns, until_turn)
    try:
        tasks = wh.run_tasks(run_id)
        task = next((t for t in tasks.tasks if t.id == parent.task_id), None) if tasks else None
        task = task or wh.adhoc_task(run_id, parent.task_id)  # a `sandflow run --query` episode
    except (ValueError, OSError) as exc:
        raise ReplayError(f"--replay {source}: the run's recorded tasks cannot be read: {exc}") from None
    if task is None:
        raise ReplayError(
            f"--replay {source}: run {run_id} did not record task {parent.task_id!r} (runs from "
            "before sandflow kept their tasks cannot be replayed: the task's files are part of "
            "the state)"
        )
    return ReplayPlan(task, parent, turns, until_turn, tuple(ignore), allow_divergence)
