"""Prompt token ids are stored as deltas on the previous turn's and read back in full.

Real files and DuckDB: what the `turns` view returns must equal what the server sent,
turn by turn, before and after compaction and a re-record; the stored rows are smaller.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from tasks.records import TurnRecord
from tests.warehouse.factory import make_episode, record
from warehouse import Warehouse
from warehouse.convert import prompt_id_deltas


def _with_ids(turns: list[TurnRecord], seed: int) -> list[TurnRecord]:
    """Prompts as a server sends them: each extends the last by the reply and the tool
    output; turn 3's history was cut (a context-length retry), turn 5 has no ids."""
    prompt = [seed + i for i in range(50)]
    out = []
    for t in turns:
        i = t.turn_index
        if i == 3:
            prompt = prompt[:20] + [7, 7, 7]
        ids = None if i == 5 else list(prompt)
        completion = [900 + i, 901 + i]
        out.append(t.model_copy(update={"prompt_token_ids": ids, "completion_token_ids": completion}))
        prompt = prompt + completion + [500 + i] * (5 + i)
    return out


def _episode(run: str, task: str, seed: int, turns: int = 7):
    ep, ts = make_episode(run, task, turns=turns)
    return ep, _with_ids(ts, seed)


def _full_ids(wh: Warehouse, run: str) -> dict[tuple[str, int], list[int] | None]:
    t = wh.turns(run)
    return {
        (e, i): ids
        for e, i, ids in zip(
            t["episode_id"].to_pylist(), t["turn_index"].to_pylist(), t["prompt_token_ids"].to_pylist(), strict=True
        )
    }


def test_deltas_are_computed_only_where_the_prompt_extends_the_last() -> None:
    _, turns = _episode("r1", "t0", 0)
    stored, prefix = prompt_id_deltas(turns)
    assert prefix == [None, 50, 57, None, 23, None, None]  # each: the previous prompt's length
    assert stored[0] == turns[0].prompt_token_ids and stored[3] == turns[3].prompt_token_ids
    assert stored[1] == turns[1].prompt_token_ids[50:]  # type: ignore[index]
    assert stored[5] is None and stored[6] == turns[6].prompt_token_ids  # no ids before it
    dup = [turns[0], turns[1], turns[1]]
    assert prompt_id_deltas(dup)[1] == [None, None, None]  # repeated index: all in full


def test_turns_view_rebuilds_the_full_ids(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    sent: dict[tuple[str, int], list[int] | None] = {}
    with wh.writer(durability="flush") as w:
        for k in range(3):
            ep, turns = _episode("r1", f"t{k}", 1000 * k)
            record(w, ep, turns)
            sent.update({(ep.episode_id, t.turn_index): t.prompt_token_ids for t in turns})
        plain, plain_turns = make_episode("r1", "plain", turns=2)  # no token ids at all
        record(w, plain, plain_turns)
        sent.update({(plain.episode_id, t.turn_index): None for t in plain_turns})
    assert _full_ids(wh, "r1") == sent
    files = list((tmp_path / "turns" / "run_id=r1").glob("*.parquet"))
    flags = {pq.read_metadata(f).metadata.get(b"sandflow.prompt_deltas") for f in files}
    assert flags == {b"1", None}  # only the files holding deltas say so
    with wh.query(run_id="r1") as q:
        ((stored, full),) = q.rows(
            "SELECT sum(len(prompt_token_ids)), (SELECT sum(len(prompt_token_ids)) FROM turns) FROM _raw_turns"
        )
    assert full == sum(len(v) for v in sent.values() if v) and stored < 0.6 * full

    wh.compact("r1")
    (merged,) = (tmp_path / "turns" / "run_id=r1").glob("*.parquet")
    assert pq.read_metadata(merged).metadata.get(b"sandflow.prompt_deltas") == b"1"
    assert _full_ids(wh, "r1") == sent

    # A re-record after compaction (new attempt, other ids) wins, rebuilt from its own rows.
    ep, turns = _episode("r1", "t1", 77, turns=4)
    with wh.writer() as w:
        record(w, ep, turns)
    sent = {k: v for k, v in sent.items() if k[0] != ep.episode_id}
    sent.update({(ep.episode_id, t.turn_index): t.prompt_token_ids for t in turns})
    assert _full_ids(wh, "r1") == sent
    wh.compact("r1")
    assert _full_ids(wh, "r1") == sent


def test_partial_turns_from_a_journal_hold_full_ids(tmp_path: Path) -> None:
    wh = Warehouse(tmp_path)
    ep, turns = _episode("r1", "t0", 5, turns=3)
    w = wh.writer(durability="flush")
    w.start_episode(ep.model_copy(update={"termination": None, "ended_at": None}))
    for t in turns:
        w.record_turn(t)
    with wh.query(run_id="r1") as q:
        got = q.rows("SELECT turn_index, prompt_token_ids FROM partial_turns ORDER BY 1")
    assert got == [(t.turn_index, t.prompt_token_ids) for t in turns]
    w.finish_episode(ep)
    w.close()
    assert [ids for _, ids in sorted(_full_ids(wh, "r1").items())] == [t.prompt_token_ids for t in turns]
