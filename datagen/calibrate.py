"""Calibrate: keep the candidate tasks the base policy solves sometimes, not always or never.

The base policy runs k samples of every candidate in the sandbox (the caller hands in a
`PolicyRunner`; `engine_policy` is the one sandflow uses: the run engine, engine.run,
as a library call, with no orchestrator in it), the samples are scored by each task's
own verifier, and a task's pass rate is the share of
its scored samples that passed (score >= `pass_score`, 1.0 by default: a full answer).
Infrastructure failures are not samples (they are not the policy's answer).

The band: by default (`Band()`) all-fail (0) and all-pass (1) are dropped, the groups
that give GRPO/RLOO no signal; `Band.parse("0.2:0.8")` keeps 0.2 <= rate <= 0.8.
Drop reasons: all_fail, all_pass, below_band, above_band, no_samples.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from analysis.scoring import score_episodes
from datagen.budget import BudgetExhausted
from datasets_prep.io import read_taskset
from engine import RunSpec
from engine import run as engine_run
from warehouse import Warehouse
from warehouse.rundata import RunData

REASONS = ("all_fail", "all_pass", "below_band", "above_band", "no_samples")


class PolicyRunner(Protocol):
    """Runs `samples` episodes of every task of the task-set file in the sandbox under
    `run_id` (resumable: a re-run skips the done ones), scores them, and returns the run."""

    def __call__(self, task_set: str, run_id: str, samples: int) -> RunData: ...


def engine_policy(spec: RunSpec, warehouse: str | Path, executor: Any = None) -> PolicyRunner:
    """The base policy of `spec` (model, endpoint, sandbox, limits) through the run engine:
    `samples` episodes of every task of the task-set file in the sandbox under `run_id`
    (resumable: a re-run with the same id skips the finished episodes), recorded in
    `warehouse`, scored by each task's own verifier (the scores stored as the score flow
    stores them), and read back. `executor`: how episodes fan out (engine.executors;
    default: the engine's threads). No endpoint in `spec`: the engine starts the
    embedded model for the run. A run the spec's budget stopped (`budget_exhausted`)
    raises BudgetExhausted: a partial run is not graded."""
    root = str(Path(warehouse).expanduser())

    def run(task_set: str, run_id: str, samples: int) -> RunData:
        ts = read_taskset(task_set)
        one = spec.replace(task_set=task_set, run_id=run_id, samples=samples, mode="sandbox",
                           warehouse=root)
        summary = engine_run(ts, one, executor=executor).summary
        if summary.get("status") == "budget_exhausted":  # nothing graded from a partial run
            raise BudgetExhausted(
                f"calibration run {run_id} stopped on the build's budget: {summary.get('cancel_reason')}. "
                "Resume with a higher budget: the same command and --out"
            )
        wh = Warehouse(root)
        # infrastructure failures are not scored (not the policy's answer): a task with
        # no scored sample is dropped as no_samples, never as all_fail
        rows, _problems = score_episodes(wh.load_run(run_id, with_turns=False),
                                         {t.id: t for t in ts.tasks}, None)
        if rows:
            wh.write_scores(rows)
        return wh.load_run(run_id, with_turns=False)

    return run


@dataclass(frozen=True)
class Band:
    """Pass rates kept: low..high inclusive; `exclusive=True` (the default band 0:1) keeps
    0 < rate < 1."""

    low: float = 0.0
    high: float = 1.0
    exclusive: bool = True

    @classmethod
    def parse(cls, spec: str | None) -> Band:
        if spec is None or spec.strip() in ("", "auto"):
            return cls()
        try:
            lo_s, hi_s = spec.split(":")
            lo, hi = float(lo_s), float(hi_s)
        except ValueError:
            raise ValueError(f"band {spec!r}: give LOW:HIGH pass rates, e.g. 0.2:0.8 (or 'auto')") from None
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"band {spec!r}: need 0 <= LOW <= HIGH <= 1")
        return cls(lo, hi, exclusive=False)

    def __str__(self) -> str:
        return "0 < rate < 1 (all-fail and all-pass dropped)" if self.exclusive else f"{self.low} <= rate <= {self.high}"

    def verdict(self, rate: float) -> str | None:
        """None when kept, else the drop reason."""
        if self.exclusive:
            return "all_fail" if rate <= 0 else "all_pass" if rate >= 1 else None
        if rate < self.low:
            return "all_fail" if rate == 0 else "below_band"
        if rate > self.high:
            return "all_pass" if rate == 1 else "above_band"
        return None


@dataclass(frozen=True)
class PassRate:
    task_id: str
    samples: int
    passes: int

    @property
    def rate(self) -> float | None:
        return self.passes / self.samples if self.samples else None


def pass_rates(data: RunData, task_ids: Iterable[str], pass_score: float = 1.0) -> dict[str, PassRate]:
    """Scored, non-infrastructure samples and passes per task (tasks never run: 0 samples)."""
    samples: dict[str, int] = dict.fromkeys(task_ids, 0)
    passes: dict[str, int] = dict.fromkeys(samples, 0)
    for e in data.episodes:
        if e.task_id not in samples or e.is_infra_failure or e.termination is None:
            continue
        s = data.scores.get(e.episode_id)
        if s is None:
            continue
        samples[e.task_id] += 1
        passes[e.task_id] += int(s.score >= pass_score)
    return {t: PassRate(t, samples[t], passes[t]) for t in samples}


def select(rates: dict[str, PassRate], band: Band) -> dict[str, str | None]:
    """task id -> None (kept) or the drop reason."""
    out: dict[str, str | None] = {}
    for tid, pr in rates.items():
        out[tid] = "no_samples" if pr.rate is None else band.verdict(pr.rate)
    return out
