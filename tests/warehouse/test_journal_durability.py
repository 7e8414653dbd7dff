"""The journal's promises per durability: what survives kill -9, and the group commit.

kill -9 is real (a subprocess kills itself the instant `record_turn` returns); the group
commit is observed through the process's one syncer (its pass and sync counters), never
through timings.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.warehouse.factory import make_episode
from warehouse import EpisodeWriter
from warehouse.journal import _SYNCER, Journal, read_journal

ROOT = Path(__file__).resolve().parents[2]

KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from tests.warehouse.factory import make_episode
    from warehouse import EpisodeWriter
    root, durability, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    w = EpisodeWriter(root, durability=durability)
    ep, turns = make_episode("k9", "doomed", turns=n)
    w.start_episode(ep.model_copy(update={"termination": None}))
    for t in turns:
        w.record_turn(t)
    os.kill(os.getpid(), signal.SIGKILL)   # no exit handler, no flush, no close
    """
)


@pytest.mark.parametrize("durability", ["turn", "sync", "flush"])
def test_kill_9_right_after_record_turn_loses_nothing(tmp_path: Path, durability: str) -> None:
    """Every mode: a line is written to the kernel before record_turn returns, so a
    process killed at that instant keeps all of them (the page cache outlives it)."""
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path), durability, "7"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -9, proc.stderr
    ep, turns = make_episode("k9", "doomed", turns=7)
    from warehouse.layout import Layout

    c = read_journal(Layout(tmp_path).journal_path("k9", ep.episode_id))
    assert c.problems == []
    assert c.episode is not None and c.episode.episode_id == ep.episode_id
    assert [t.turn_index for t in c.turns] == list(range(7))
    assert [t.assistant_content for t in c.turns] == [t.assistant_content for t in turns]


def test_turn_mode_never_waits_for_the_disk_until_it_falls_behind(tmp_path: Path) -> None:
    """durability="turn": record_turn returns without waiting for the disk while fewer
    than MAX_UNSYNCED lines of the episode are pending; then it waits for the syncer, so
    an OS crash can take at most MAX_UNSYNCED records of an open episode."""
    from warehouse.journal import MAX_UNSYNCED

    w = EpisodeWriter(tmp_path, durability="turn")
    ep, turns = make_episode("r1", "t1", turns=MAX_UNSYNCED + 2)
    with _SYNCER.lock:  # the syncer cannot start a pass while we hold this
        w.start_episode(ep)
        journal = w._open[("r1", ep.episode_id)].journal
        for t in turns[: MAX_UNSYNCED - 1]:
            w.record_turn(t)
        assert (journal._written, journal._synced) == (MAX_UNSYNCED, 0)  # nobody waited
        w.record_turn(turns[MAX_UNSYNCED - 1])  # one more: waits (the lock is released meanwhile)
        assert journal._synced >= 1
        assert journal._written - journal._synced <= MAX_UNSYNCED
    for t in turns[MAX_UNSYNCED:]:
        w.record_turn(t)
        assert journal._written - journal._synced <= MAX_UNSYNCED
    journal.wait_synced()
    assert journal._synced == journal._written == len(turns) + 1  # header + turns
    w.finish_episode(ep)


def test_one_pass_syncs_many_journals(tmp_path: Path) -> None:
    """Group commit: lines of many episodes written together go to disk in ONE pass of the
    syncer (one fdatasync per journal, not one wake-up per line)."""
    episodes = [make_episode("r1", f"t{k}", turns=1) for k in range(8)]
    journals = [Journal(tmp_path / f"{ep.episode_id}.jsonl", ep, "turn") for ep, _ in episodes]
    for j in journals:
        j.wait_synced()  # the headers are on disk: the next line need not wait
    with _SYNCER.lock:  # the syncer cannot start a pass until all 8 lines are written
        passes, syncs = _SYNCER.passes, _SYNCER.syncs
        for j, (_, turns) in zip(journals, episodes, strict=True):
            j.append(turns[0])
    for j in journals:
        j.wait_synced()
    with _SYNCER.lock:
        assert _SYNCER.passes - passes == 1
        assert _SYNCER.syncs - syncs == 8
    for j in journals:
        assert j._synced == j._written == 2
        j.close(remove=True)
    assert not list(tmp_path.glob("*.jsonl"))


def test_threads_recording_at_once_all_land_synced(tmp_path: Path) -> None:
    """Many episodes recorded by many threads through one writer: every journal fully
    synced before it is kept (close(remove=False)), every turn committed."""
    w = EpisodeWriter(tmp_path, durability="turn")
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            ep, turns = make_episode("threads", f"t{k}", turns=10)
            w.start_episode(ep)
            for t in turns:
                w.record_turn(t)
            if k % 2:
                w.finish_episode(ep)
            else:
                w.abandon("threads", ep.episode_id)  # kept as an orphan: synced first
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    from warehouse import Warehouse

    wh = Warehouse(tmp_path)
    assert len(wh.episodes("threads")) == 4
    assert len(wh.turns("threads")) == 40
    orphans = wh.orphans("threads")
    assert sorted(o.turns for o in orphans) == [10, 10, 10, 10]
