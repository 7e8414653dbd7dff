"""Commit one episode: its turns file, then its episode file (the commit point), atomically.

Both the live writer (writer.py) and journal recovery (recovery.py) end an episode here,
so neither needs the other: writer -> recovery -> commit, one way.
"""

from __future__ import annotations

from tasks.records import EpisodeRecord, TurnRecord
from warehouse.convert import episode_row, now_utc, rows_table, turns_table
from warehouse.layout import Layout, new_id, write_parquet_files_atomic


class RecordError(ValueError):
    """A record the warehouse cannot store as given (the message says which and why)."""


def commit_episode(
    layout: Layout,
    episode: EpisodeRecord,
    turns: list[TurnRecord],
    *,
    durable: bool = True,
) -> str:
    """Write one episode's turns and summary atomically; returns the attempt's write_id.

    Order matters: the turns file first, the episode file last. The episode row is the
    commit point: the views show turns only of the attempt its write_id names.
    """
    for t in turns:
        if t.run_id != episode.run_id or t.episode_id != episode.episode_id:
            raise RecordError(
                f"turn {t.turn_index} belongs to run {t.run_id!r} episode {t.episode_id!r}, "
                f"not to run {episode.run_id!r} episode {episode.episode_id!r}"
            )
    write_id = new_id()
    files = []
    if turns:
        files.append(
            (
                turns_table(turns, write_id, prompt_deltas=True),
                layout.turns_file(episode.run_id, episode.episode_id, write_id),
            )
        )
    ep = episode.with_totals(turns, only_missing=True)
    table = rows_table("episodes", [episode_row(ep, write_id, now_utc())])
    files.append((table, layout.episode_file(episode.run_id, episode.episode_id)))
    # Turns renamed first, the episode row last (readers never see a row without its
    # turns); durable: both files fsynced together, each rename fsynced in that order.
    write_parquet_files_atomic(files, durable=durable)
    return write_id
