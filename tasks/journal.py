"""The episode journal: ONE line format for records as they happen, and its one reader.

A journal is JSON lines, ``{"kind": "start"|"turn"|"finish", "record": {...}}``, appended
and flushed per record, so a crash loses at most the record in flight. `JournalRecorder`
writes `sandflow run`'s records.jsonl with it (and is the fallback when no warehouse
writer is given); the warehouse's per-episode journals (warehouse/journal.py) use the
same lines behind a lock. `read_journal` reads either back, tolerating a torn last line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel, ValidationError

from datasets_prep.closing import ClosedOnExit
from tasks.records import EpisodeRecord, TurnRecord

# Kinds of line. Journals written by older warehouse versions used {"k": "e"|"t", "r": ...}.
_LEGACY_KINDS = {"e": "start", "t": "turn"}


def journal_line(kind: str, record: BaseModel | dict[str, Any]) -> str:
    """One journal line (newline included) for a record or an already-dumped dict."""
    body = (
        record.model_dump_json()
        if isinstance(record, BaseModel)
        else json.dumps(record, ensure_ascii=False)
    )
    return '{"kind":"' + kind + '","record":' + body + "}\n"


class JournalRecorder(ClosedOnExit):
    """Appends {"kind": "start"|"turn"|"finish", "record": {...}} lines to `path`."""

    def __init__(self, path: Path | str, fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._fh: TextIO = self.path.open("a", encoding="utf-8")

    def _write(self, kind: str, record: EpisodeRecord | TurnRecord) -> None:
        self._fh.write(journal_line(kind, record))
        self._fh.flush()
        if self.fsync:
            os.fsync(self._fh.fileno())

    def start_episode(self, episode: EpisodeRecord) -> None:
        self._write("start", episode)

    def record_turn(self, turn: TurnRecord) -> None:
        self._write("turn", turn)

    def finish_episode(self, episode: EpisodeRecord) -> None:
        self._write("finish", episode)

    def close(self) -> None:
        self._fh.close()


@dataclass
class JournalContents:
    path: Path
    episode: EpisodeRecord | None  # the "start" record: the episode as it began
    turns: list[TurnRecord] = field(default_factory=list)  # by turn index, last record wins
    finished: list[EpisodeRecord] = field(default_factory=list)  # "finish" records
    problems: list[str] = field(default_factory=list)  # lines that could not be read


def read_journal(path: Path | str) -> JournalContents:
    """Parse a journal. A torn last line (the record in flight at a crash) is skipped and
    reported; a damaged line elsewhere is reported with its line number, never fatal."""
    path = Path(path)
    out = JournalContents(path=path, episode=None)
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    last = len(lines) - 1
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if "kind" in obj:
                kind, rec = obj["kind"], obj["record"]
            else:
                kind, rec = _LEGACY_KINDS.get(obj["k"], obj["k"]), obj["r"]
            if kind == "start":
                out.episode = EpisodeRecord.model_validate(rec)
            elif kind == "turn":
                out.turns.append(TurnRecord.model_validate(rec))
            elif kind == "finish":
                out.finished.append(EpisodeRecord.model_validate(rec))
            else:
                out.problems.append(f"{path}:{n}: unknown record kind {kind!r}")
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            where = "torn last line (record in flight at the crash)" if n - 1 == last else "bad line"
            out.problems.append(f"{path}:{n}: {where}: {str(exc).splitlines()[0][:200]}")
    # Keep the last record of each turn index (a retried turn may be journaled twice).
    by_index = {t.turn_index: t for t in out.turns}
    out.turns = [by_index[i] for i in sorted(by_index)]
    return out


class TeeRecorder:
    """Sends every record to several recorders, in order (e.g. the journal and the warehouse)."""

    def __init__(self, *recorders: Any) -> None:
        self.recorders = recorders

    def start_episode(self, episode: EpisodeRecord) -> None:
        for r in self.recorders:
            r.start_episode(episode)

    def record_turn(self, turn: TurnRecord) -> None:
        for r in self.recorders:
            r.record_turn(turn)

    def finish_episode(self, episode: EpisodeRecord) -> None:
        for r in self.recorders:
            r.finish_episode(episode)
