"""Orphaned journals: episodes whose writer died before finishing them.

An orphan is a journal nobody holds the lock of (see journal.py). Two ways out:

- recover: its turns become a committed episode with ``termination='interrupted'``
  (readable in the ``episodes`` / ``turns`` views; `done_keys` does not count it, so
  resume re-runs it), and the journal moves to ``_journal/run_id=R/recovered/`` (still
  readable through the ``partial_turns`` view even after the re-run replaces the episode).
- discard: the journal is deleted (its turns are gone for good).

Until one of them happens, the ``partial_turns`` view shows the journaled turns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from warehouse.commit import commit_episode
from warehouse.journal import is_live, read_journal
from warehouse.layout import Layout
from warehouse.tempfiles import try_flock

RECOVERED_DIR = "recovered"


@dataclass(frozen=True)
class Orphan:
    run_id: str
    episode_id: str
    path: Path
    task_id: str | None
    mode: str | None
    sample_index: int | None
    turns: int
    problems: tuple[str, ...]


def _run_id_of(path: Path) -> str:
    return path.parent.name.removeprefix("run_id=")


def find_orphans(layout: Layout, run_id: str | None = None) -> list[Orphan]:
    """Journals of `run_id` (or of every run) that no live writer holds."""
    out = []
    for path in layout.journal_files(run_id):
        if is_live(path):
            continue
        try:
            c = read_journal(path)
        except FileNotFoundError:  # finished or recovered meanwhile
            continue
        ep = c.episode
        out.append(
            Orphan(
                run_id=_run_id_of(path),
                episode_id=path.stem,
                path=path,
                task_id=ep.task_id if ep else None,
                mode=ep.mode if ep else None,
                sample_index=ep.sample_index if ep else None,
                turns=len(c.turns),
                problems=tuple(c.problems),
            )
        )
    return out


def recover_journal(layout: Layout, path: Path) -> str | None:
    """Commit an orphan journal as an 'interrupted' episode; returns its write_id.

    Returns None when the journal is live (someone is writing it), gone, or has no
    episode header (nothing identifies the episode; it is then deleted if empty).
    """
    try:
        with try_flock(path) as fd:
            return None if fd is None else _commit_orphan(layout, path, fd)
    except FileNotFoundError:
        return None


def _commit_orphan(layout: Layout, path: Path, fd: int) -> str | None:
    """recover_journal's work, under the journal's lock (`fd`)."""
    c = read_journal(path)
    if c.episode is None:
        if not c.turns:
            path.unlink(missing_ok=True)
        return None
    last = max((t.started_at for t in c.turns), default=None)
    ended = last or datetime.fromtimestamp(os.fstat(fd).st_mtime, UTC)
    note = f"recovered from journal after the writer died: {len(c.turns)} turn(s) kept"
    if c.problems:
        note += f"; {len(c.problems)} unreadable line(s): {c.problems[-1]}"
    ep = c.episode.model_copy(
        update={"termination": "interrupted", "ended_at": ended, "error": note}
    )
    write_id = commit_episode(layout, ep, c.turns)
    archive = path.parent / RECOVERED_DIR / f"{path.stem}.{write_id}.jsonl"
    archive.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, archive)
    return write_id


def recover_orphans(
    layout: Layout, run_id: str | None = None, action: Literal["recover", "discard"] = "recover"
) -> list[Orphan]:
    """Recover (or discard) every orphan of `run_id`; returns the ones handled."""
    if action not in ("recover", "discard"):
        raise ValueError(f"action must be 'recover' or 'discard', not {action!r}")
    handled = []
    for o in find_orphans(layout, run_id):
        if action == "recover":
            if recover_journal(layout, o.path) is not None:
                handled.append(o)
        elif not is_live(o.path):
            o.path.unlink(missing_ok=True)
            handled.append(o)
    return handled


def recovered_journals(layout: Layout, run_id: str | None = None) -> list[Path]:
    base = layout.root / "_journal"
    dirs = [layout.journal_dir(run_id)] if run_id else sorted(base.glob("run_id=*"))
    return [p for d in dirs for p in sorted((d / RECOVERED_DIR).glob("*.jsonl"))]
