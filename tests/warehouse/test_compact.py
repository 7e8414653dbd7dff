"""compact(run_id): one file per table, atomic switch, idempotence kept."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse


def _fill(wh: Warehouse, run: str, n: int = 12) -> None:
    with wh.writer(durability="flush") as w:
        for k in range(n):
            ep, turns = make_episode(run, f"t{k}", turns=1 + k % 4)
            record(w, ep, turns)
    wh.write_scores(
        [
            {"run_id": run, "episode_id": e, "verifier": "exact", "score": 1.0}
            for e in wh.done_episode_ids(run)
        ]
    )


def _state(wh: Warehouse, run: str) -> tuple[list, list, list]:
    with wh.query(run_id=run) as q:
        return (
            q.rows("SELECT episode_id, answer, num_turns FROM episodes ORDER BY 1"),
            q.rows("SELECT episode_id, turn_index, assistant_content FROM turns ORDER BY 1, 2"),
            q.rows("SELECT episode_id, verifier, score FROM scores ORDER BY 1"),
        )


def test_compaction_merges_and_keeps_every_row(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    _fill(wh, "r1")
    _fill(wh, "other", 3)
    before = _state(wh, "r1")
    res = wh.compact("r1")
    assert res.files_before == {"episodes": 12, "turns": 12, "scores": 1}
    assert res.rows_after["turns"] == sum(1 + k % 4 for k in range(12))
    for table in ("episodes", "turns"):
        names = [p.name for p in (tmp_path / table / "run_id=r1").glob("*.parquet")]
        assert len(names) == 1 and names[0].startswith("compacted-"), names
    assert _state(wh, "r1") == before
    # sorted by episode and turn inside the file
    with wh.query(run_id="r1") as q:
        keys = q.rows("SELECT episode_id, turn_index FROM _raw_turns")
    assert keys == sorted(keys)
    assert len(list((tmp_path / "turns" / "run_id=other").glob("*.parquet"))) == 3  # untouched
    # compacting again is a no-op
    assert not wh.compact("r1").changed


def test_rerecord_after_compaction_replaces(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    _fill(wh, "r1")
    wh.compact("r1")
    ep, turns = make_episode("r1", "t5", turns=7, answer="redo")
    with wh.writer() as w:
        record(w, ep, turns)
    with wh.query(run_id="r1") as q:
        assert q.rows(
            f"SELECT answer, num_turns FROM episodes WHERE episode_id = '{ep.episode_id}'"
        ) == [("redo", 7)]
        assert q.rows(f"SELECT count(*) FROM turns WHERE episode_id = '{ep.episode_id}'") == [(7,)]
        assert q.rows("SELECT count(*) FROM episodes") == [(12,)]
    # A second compaction folds the re-record in and drops the superseded attempt.
    before = _state(wh, "r1")
    wh.compact("r1")
    assert _state(wh, "r1") == before
    with wh.query(run_id="r1") as q:
        assert q.rows(f"SELECT count(*) FROM _raw_turns WHERE episode_id = '{ep.episode_id}'") == [
            (7,)
        ]
        assert q.rows("SELECT count(*) FROM _raw_episodes") == [(12,)]


def test_rescore_after_compaction_newest_batch_wins(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    _fill(wh, "r1", 4)
    wh.compact("r1")
    wh.write_scores(
        [
            {"run_id": "r1", "episode_id": e, "verifier": "exact", "score": 0.0}
            for e in wh.done_episode_ids("r1")
        ]
    )
    with wh.query(run_id="r1") as q:
        assert q.rows("SELECT count(*), sum(score) FROM scores") == [(4, 0.0)]


def test_readers_never_see_a_half_state_during_compaction(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    _fill(wh, "r1", 30)
    expected = _state(wh, "r1")
    stop = threading.Event()
    seen: list[object] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(_state(wh, "r1"))
            except Exception as exc:  # recorded and asserted below
                seen.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(3):
        # add one more episode and compact again, while readers read
        ep, turns = make_episode("r1", "t0", turns=2, answer=f"v{i}")
        with wh.writer() as w:
            record(w, ep, turns)
        wh.compact("r1")
    stop.set()
    for t in threads:
        t.join()
    assert seen, "readers ran"
    errors = [s for s in seen if isinstance(s, Exception)]
    assert not errors, errors[:3]
    for s in seen:
        eps, turns, scores = s  # type: ignore[misc]
        # t0 re-recorded (answer v<i>) after it was scored: its score is stale, left out
        rerecorded = sum(1 for e in eps if str(e[1]).startswith("v"))
        assert len(eps) == 30 and len(scores) == 30 - rerecorded
        ids = {e[0] for e in eps}
        n_turns = {e[0]: e[2] for e in eps}
        got: dict[str, int] = {}
        for eid, _, _ in turns:
            got[eid] = got.get(eid, 0) + 1
        assert set(got) <= ids
        assert got == {k: v for k, v in n_turns.items() if v}, "turns match their episode"
    assert len(_state(wh, "r1")[1]) == len(expected[1]) - 1 + 2  # t0 had 1 turn, now 2


def test_an_open_session_keeps_its_snapshot_across_rerecord_and_compaction(
    tmp_path: Path,
) -> None:
    wh = Warehouse(tmp_path)
    _fill(wh, "r1", 6)
    ep, turns = make_episode("r1", "t0", turns=3, answer="redo")
    with wh.query(run_id="r1") as q:
        before = q.rows("SELECT episode_id, num_turns FROM episodes ORDER BY 1")
        with wh.writer() as w:
            record(w, ep, turns)  # rewrites the episode file this session listed
        wh.compact("r1")  # merges (but must not delete) files this session reads
        assert q.rows("SELECT episode_id, num_turns FROM episodes ORDER BY 1") == before
        assert q.rows("SELECT episode_id, count(*) FROM turns GROUP BY 1 ORDER BY 1") == before
    assert len(list((tmp_path / "turns" / "run_id=r1").glob("*.parquet"))) > 1  # kept, hidden
    assert ("redo", 3) in [e[1:] for e in _state(wh, "r1")[0]]
    wh.compact("r1")  # no session open: the hidden leftovers go
    for table in ("episodes", "turns"):
        names = [p.name for p in (tmp_path / table / "run_id=r1").glob("*.parquet")]
        assert len(names) == 1 and names[0].startswith("compacted-"), names
    assert ("redo", 3) in [e[1:] for e in _state(wh, "r1")[0]]


def test_pending_deletes_counts_files_kept_for_an_open_session(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    _fill(wh, "r1", 5)
    with wh.query(run_id="r1") as q:
        res = wh.compact("r1")
        assert res.pending_deletes == 5 + 5 + 1  # episodes, turns, the scores batch
        assert q.rows("SELECT count(*) FROM episodes") == [(5,)]  # its snapshot still reads
    assert wh.compact("r1").pending_deletes == 0  # no session open: deleted now
    for table in ("episodes", "turns", "scores"):
        names = [p.name for p in (tmp_path / table / "run_id=r1").glob("*.parquet")]
        assert len(names) == 1 and names[0].startswith("compacted-"), names


def test_a_run_whose_only_turns_are_superseded_compacts(tmp_path: Path) -> None:
    """An episode re-recorded with no turns (a sandbox that failed to start on the retry)
    leaves only a superseded attempt's turns file: compaction drops it, never fails."""
    wh = Warehouse(tmp_path)
    ep, turns = make_episode("r1", "t0", turns=3)
    with wh.writer(durability="flush") as w:
        record(w, ep, turns)
    again, _ = make_episode("r1", "t0", turns=0, termination="sandbox_error", answer=None)
    with wh.writer(durability="flush") as w:
        record(w, again, [])
    res = wh.compact("r1")
    assert res.files_before == {"episodes": 1, "turns": 1}  # an episode file is replaced per key
    assert res.rows_after == {"episodes": 1, "turns": 0}
    with wh.query(run_id="r1") as q:
        assert q.rows("SELECT termination, num_turns FROM episodes") == [("sandbox_error", 0)]
        assert q.rows("SELECT count(*) FROM _raw_turns") == [(0,)]


def _rerecord_while(wh: Warehouse, work: Callable[[], None], *, writes: int, works: int) -> list[str]:
    """Re-record episode t0 every few milliseconds (answers of different lengths: files
    of different sizes under one name) while `work` runs in this thread, until there were
    at least `writes` re-records and `works` calls of `work` (however long a loaded machine
    takes); the answers written, in order."""
    stop = threading.Event()
    written: list[str] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            answer = "x" * (1 + (i * 37) % 400)
            ep, turns = make_episode("r1", "t0", turns=1 + i % 3, answer=answer)
            with wh.writer() as w:
                record(w, ep, turns)
            written.append(answer)
            i += 1
            stop.wait(0.005)

    t = threading.Thread(target=writer)
    t.start()
    done = 0
    deadline = time.monotonic() + 600  # a bound for a hung writer, not a timing
    try:
        while (len(written) < writes or done < works) and time.monotonic() < deadline:
            work()
            done += 1
    finally:
        stop.set()
        t.join()
    assert len(written) >= writes and done >= works, (len(written), done)
    return written


def test_a_reader_never_fails_while_an_episode_file_is_renamed_over(tmp_path: Path) -> None:
    # DuckDB opens a file by its path more than once per query: a re-record renaming a new
    # file over it in between once made the session fail ("TProtocolException: Invalid
    # data") or could mix two versions. The reader must see one whole version, every time.
    wh = Warehouse(tmp_path)
    _fill(wh, "r1", 8)
    seen: list[tuple[str, int, int]] = []

    def read() -> None:
        with wh.query(run_id="r1") as q:
            eid = make_episode("r1", "t0")[0].episode_id
            ((answer, num_turns),) = q.rows(
                f"SELECT answer, num_turns FROM episodes WHERE episode_id = '{eid}'"
            )
            ((n,),) = q.rows(f"SELECT count(*) FROM turns WHERE episode_id = '{eid}'")
            seen.append((answer, num_turns, n))

    written = _rerecord_while(wh, read, writes=150, works=40)
    for answer, num_turns, n in seen:
        assert answer == "42" or answer in written
        assert n == num_turns, "the episode's own turns, from the same version"


def test_a_rerecord_during_compaction_is_never_hidden(tmp_path: Path) -> None:
    # Compaction hides the versions it merged: never a newer one renamed over the name
    # while it was merging (that one stays visible and wins).
    wh = Warehouse(tmp_path)
    _fill(wh, "r1", 8)
    eid = make_episode("r1", "t0")[0].episode_id
    written = _rerecord_while(wh, lambda: wh.compact("r1"), writes=100, works=20)
    with wh.query(run_id="r1") as q:
        assert q.rows(f"SELECT answer FROM episodes WHERE episode_id = '{eid}'") == [
            (written[-1],)
        ]
        assert q.rows("SELECT count(*) FROM episodes") == [(8,)]
