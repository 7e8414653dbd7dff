"""A warehouse of nights, written through the real writer (Parquet files, run rows,
score batches), from a plan that also gives the Python side its outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from analysis.comparisons import Outcome
from tasks.records import EpisodeRecord, episode_key

T0 = datetime(2026, 3, 1, 2, 0, tzinfo=UTC)
INFRA = "infra"  # an outcome that is an infrastructure failure, not an answer


@dataclass
class NightPlan:
    run_id: str
    day: int
    # (mode, task_id, sample) -> score, or INFRA
    outcomes: dict[tuple[str, str, int], float | str]
    domains: dict[str, str]  # task_id -> domain
    model: str = "m1"
    series: str | None = "nightly"
    dataset_hash: str = "hash-a"
    image: str | None = "sandflow:img"
    image_id: str | None = "sha256:aaa"
    status: str = "finished"
    extra: dict[str, object] = field(default_factory=dict)
    config: dict[str, object] | None = None  # the run's config (e.g. its "prompts")

    def outcome_list(self) -> list[Outcome]:
        out = []
        for (mode, task, sample), v in sorted(self.outcomes.items()):
            infra = v == INFRA
            out.append(
                Outcome(
                    run_id=self.run_id,
                    episode_id=episode_key(self.run_id, task, mode, sample),
                    task_id=task,
                    domain=self.domains[task],
                    mode=mode,
                    sample_index=sample,
                    score=None if infra else float(v),
                    passed=None if infra else float(v) >= 1.0,
                    infra_failure=infra,
                )
            )
        return out


def write_night(root: Path, night: NightPlan) -> None:
    from warehouse.layout import Layout
    from warehouse.runs import finish_run, write_run
    from warehouse.store import Warehouse
    from warehouse.writer import commit_episode

    layout = Layout(root)
    start = T0 + timedelta(days=night.day)
    write_run(
        layout, night.run_id, model=night.model, image=night.image, image_id=night.image_id,
        dataset="tiny", dataset_hash=night.dataset_hash, series=night.series, started_at=start,
        config=night.config,
    )  # fmt: skip
    scores = []
    for o in night.outcome_list():
        ep = EpisodeRecord(
            run_id=o.run_id, episode_id=o.episode_id, task_id=o.task_id, domain=o.domain,
            mode=o.mode, sample_index=o.sample_index, model=night.model, started_at=start,  # type: ignore[arg-type]
            ended_at=start + timedelta(seconds=5),
            termination="sandbox_error" if o.infra_failure else "submitted",
            answer=None if o.infra_failure else "x", num_turns=2, prompt_tokens=100, completion_tokens=20,
            wall_s=5.0,
        )  # fmt: skip
        wid = commit_episode(layout, ep, [], durable=False)
        if not o.infra_failure:
            scores.append(
                {
                    "run_id": o.run_id,
                    "episode_id": o.episode_id,
                    "verifier": "exact",
                    "score": o.score,
                    "passed": o.passed,
                    "episode_write_id": wid,
                }  # fmt: skip
            )
    if scores:
        Warehouse(root).write_scores(scores, scored_at=start + timedelta(hours=1))
    finish_run(layout, night.run_id, status=night.status, ended_at=start + timedelta(minutes=30))
