"""One run's records in memory: episodes, their turns, and their scores.

What the warehouse hands back for one run (`Warehouse.load_run`). analysis/ (usage,
tokens, rollouts, report) works on these contract types (tasks.records) rather than on
SQL rows, so its logic is testable without a warehouse and does not care how the
warehouse lays out its files.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tasks.records import EpisodeRecord, TurnRecord


@dataclass
class Score:
    episode_id: str
    score: float
    verifier: str = "auto"
    passed: bool | None = None
    reason: str | None = None


@dataclass
class RunData:
    run_id: str
    episodes: list[EpisodeRecord] = field(default_factory=list)
    turns: dict[str, list[TurnRecord]] = field(default_factory=dict)  # episode_id -> turns
    scores: dict[str, Score] = field(default_factory=dict)  # episode_id -> score
    # episode_id -> write_id of its current recording attempt (scores name the one they scored)
    attempts: dict[str, str] = field(default_factory=dict)
    skipped_files: list[str] = field(default_factory=list)  # bad files left out, with reasons

    @classmethod
    def from_records(
        cls,
        run_id: str,
        episodes: list[EpisodeRecord],
        turns: list[TurnRecord],
        scores: dict[str, float | Score] | None = None,
    ) -> RunData:
        by_ep: dict[str, list[TurnRecord]] = defaultdict(list)
        for t in turns:
            by_ep[t.episode_id].append(t)
        for lst in by_ep.values():
            lst.sort(key=lambda t: t.turn_index)
        sc: dict[str, Score] = {}
        for k, v in (scores or {}).items():
            sc[k] = v if isinstance(v, Score) else Score(episode_id=k, score=float(v))
        return cls(run_id=run_id, episodes=list(episodes), turns=dict(by_ep), scores=sc)

    def turns_of(self, episode_id: str) -> list[TurnRecord]:
        return self.turns.get(episode_id, [])

    @property
    def finished(self) -> list[EpisodeRecord]:
        """Episodes that ended with the model's own result (infrastructure failures left out)."""
        return [e for e in self.episodes if e.termination and not e.is_infra_failure]


def latest_scores(rows: list[dict[str, Any]], verifier: str | None = None) -> dict[str, Score]:
    """episode_id -> Score from the latest batch (of `verifier`, when given)."""
    out: dict[str, tuple[str, Score]] = {}
    for r in rows:
        if verifier and r["verifier"] != verifier and not str(r["verifier"]).startswith(verifier + ":"):
            continue
        if r["score"] is None:
            continue
        key = r["episode_id"]
        if key not in out or str(r["batch_id"]) > out[key][0]:
            out[key] = (
                str(r["batch_id"]),
                Score(key, float(r["score"]), str(r["verifier"]), r["passed"], r["reason"]),
            )
    return {k: v for k, (_b, v) in out.items()}
