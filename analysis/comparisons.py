"""Episode outcomes -> the tables a nightly report shows, with their uncertainty.

An `Outcome` is one episode's verdict (the warehouse's `episode_outcomes` view, or a
run's records). From outcomes:

- `accuracy_intervals`: accuracy per domain x mode (and over all domains) with a
  task-clustered SE and bootstrap interval (statistics.mean_interval);
- `compare_runs`: tonight against another run on the same task set, matched by
  (mode, task id): per domain x mode and overall, the difference with its interval, the
  flipped tasks, an exact test, Holm-adjusted across the comparison's rows;
- `compare_modes`: sandbox against LLM mode of one run, matched by task id (the paper's
  main table, with intervals);
- `flaky_tasks`: tasks whose outcome flips between consecutive nights of a series
  while the image stayed the same.

Infrastructure failures are never a wrong answer: they are counted apart on each side,
and a task without a scored sample on both sides is "unmatched", not a flip.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from analysis.statistics import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    Interval,
    Paired,
    holm,
    mean_interval,
    paired_comparison,
    solved,
)

if TYPE_CHECKING:
    from tasks.records import EpisodeRecord

ALL = "(all)"
DEFAULT_ALPHA = 0.05


# ------------------------------------------------------------------------ outcomes
@dataclass(frozen=True)
class Outcome:
    """One episode's verdict. `score` None: not scored; infra failures are not answers."""

    run_id: str
    episode_id: str
    task_id: str
    domain: str
    mode: str
    sample_index: int = 0
    score: float | None = None
    passed: bool | None = None
    infra_failure: bool = False

    @property
    def scored(self) -> bool:
        return not self.infra_failure and self.score is not None


def outcomes_from_rows(rows: Iterable[Mapping[str, Any]]) -> list[Outcome]:
    """Rows of the `episode_outcomes` view (dicts) -> outcomes."""
    out = []
    for r in rows:
        score = r.get("score")
        passed = r.get("passed")
        out.append(
            Outcome(
                run_id=str(r["run_id"]),
                episode_id=str(r["episode_id"]),
                task_id=str(r.get("task_id") or ""),
                domain=str(r.get("domain") or ""),
                mode=str(r.get("mode") or ""),
                sample_index=int(r.get("sample_index") or 0),
                score=None if score is None else float(score),
                passed=None if passed is None else bool(passed),
                infra_failure=bool(r.get("infra_failure")),
            )
        )
    return out


def outcomes_from_episodes(episodes: Iterable[EpisodeRecord], scores: Mapping[str, Any]) -> list[Outcome]:
    """A run's episode records and its scores (episode_id -> object with .score, .passed).

    An episode without a termination (unfinished) counts as an infrastructure failure,
    as in the accuracy table.
    """
    out = []
    for e in episodes:
        s = scores.get(e.episode_id)
        infra = bool(e.is_infra_failure) or e.termination is None
        out.append(
            Outcome(
                **e.identity(),
                score=None if s is None else float(s.score),
                passed=None if s is None or s.passed is None else bool(s.passed),
                infra_failure=infra,
            )
        )
    return out


@dataclass(frozen=True)
class TaskResult:
    """A task's outcome in one run and mode: the mean of its scored samples."""

    task_id: str
    domain: str
    mode: str
    mean: float | None  # None: no scored sample (infra failures only, or unscored)
    samples: int  # scored samples
    infra: int  # infrastructure failures
    episode_ids: tuple[str, ...]


def task_results(outcomes: Iterable[Outcome]) -> dict[tuple[str, str], TaskResult]:
    """(mode, task_id) -> TaskResult."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for o in outcomes:
        a = acc.setdefault(
            (o.mode, o.task_id), {"domain": o.domain, "scores": [], "infra": 0, "eps": []}
        )
        a["eps"].append((o.sample_index, o.episode_id))
        if o.infra_failure:
            a["infra"] += 1
        elif o.score is not None:
            a["scores"].append(o.score)
    return {
        (mode, task): TaskResult(
            task_id=task,
            domain=a["domain"],
            mode=mode,
            mean=float(np.mean(a["scores"])) if a["scores"] else None,
            samples=len(a["scores"]),
            infra=a["infra"],
            episode_ids=tuple(e for _i, e in sorted(a["eps"])),
        )
        for (mode, task), a in acc.items()
    }


# ------------------------------------------------------------------------ accuracy
def accuracy_intervals(
    outcomes: Iterable[Outcome],
    *,
    level: float = DEFAULT_LEVEL,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> dict[tuple[str, str], Interval]:
    """(domain, mode) -> accuracy interval, plus (ALL, mode) over every domain."""
    groups: dict[tuple[str, str], tuple[list[float], list[str]]] = defaultdict(lambda: ([], []))
    for o in outcomes:
        if not o.scored:
            continue
        for key in ((o.domain, o.mode), (ALL, o.mode)):
            groups[key][0].append(float(o.score))  # type: ignore[arg-type]
            groups[key][1].append(o.task_id)
    return {
        key: mean_interval(scores, tasks, level=level, n_resamples=n_resamples, seed=seed)
        for key, (scores, tasks) in groups.items()
    }


_CI_COLUMNS = {"se": "se", "low": "ci_low", "high": "ci_high"}  # Interval.columns names


def with_intervals(
    rows: Sequence[dict[str, Any]],
    intervals: Mapping[tuple[str, str], Interval],
    *,
    scale: float = 100.0,
) -> list[dict[str, Any]]:
    """Accuracy rows (domain, mode, ...) with tasks, se, ci_low, ci_high appended (x scale)."""
    out = []
    for r in rows:
        iv = intervals.get((r["domain"], r["mode"]))
        ci = iv.columns(scale, **_CI_COLUMNS) if iv else dict.fromkeys(_CI_COLUMNS.values())
        out.append({**r, "tasks": iv.n_tasks if iv else 0, **ci})
    return out


# ------------------------------------------------------------------- comparisons
@dataclass(frozen=True)
class Flip:
    """A task whose outcome (solved: mean score >= 0.5) changed between two sides."""

    task_id: str
    domain: str
    mode: str
    before: float
    after: float
    episodes_before: tuple[str, ...]
    episodes_after: tuple[str, ...]

    @property
    def direction(self) -> str:
        return "up" if self.after > self.before else "down"


@dataclass(frozen=True)
class ComparisonRow:
    """One domain x mode of a paired comparison (B against A; diff = B - A)."""

    domain: str
    mode: str
    paired: Paired
    p_adjusted: float | None
    significant: bool
    flips: tuple[Flip, ...]
    unmatched: int  # tasks present on a side but not scored on both
    infra_a: int  # infrastructure failures (episodes) on each side
    infra_b: int

    @property
    def direction(self) -> str:
        d = self.paired.diff.estimate
        return "same" if not d else ("up" if d > 0 else "down")

    @property
    def is_regression(self) -> bool:
        return self.significant and self.direction == "down"

    def row(self, scale: float = 100.0) -> dict[str, Any]:
        """A flat table row (percentages, rounded) for reports and artifacts."""
        p = self.paired

        def pct(v: float | None) -> float | None:
            return None if v is None else round(v * scale, 1)

        return {
            "domain": self.domain,
            "mode": self.mode,
            "tasks": p.n_tasks,
            "before": pct(p.mean_a),
            "after": pct(p.mean_b),
            **p.diff.columns(scale, estimate="diff", low="diff_low", high="diff_high"),
            "down": sum(f.direction == "down" for f in self.flips),
            "up": sum(f.direction == "up" for f in self.flips),
            "test": p.test,
            "p": _round_p(p.p_value),
            "p_adj": _round_p(self.p_adjusted),
            "significant": self.significant,
            "unmatched": self.unmatched,
            "infra_before": self.infra_a,
            "infra_after": self.infra_b,
        }


def _round_p(p: float | None) -> float | None:
    return None if p is None else float(f"{p:.3g}")


@dataclass
class _Group:
    # matched tasks: before[i] (side A) and after[i] (side B), both with a mean score
    before: list[TaskResult] = field(default_factory=list)
    after: list[TaskResult] = field(default_factory=list)
    unmatched: int = 0
    infra_a: int = 0
    infra_b: int = 0


def _rows(
    groups: dict[tuple[str, str], _Group],
    *,
    alpha: float,
    level: float,
    n_resamples: int,
    seed: int,
) -> list[ComparisonRow]:
    """Paired tests per group, then Holm across the groups (one family per comparison).

    The overall row of a mode with a single domain repeats that domain's test exactly,
    so it is not counted twice in the family: it takes its domain's adjusted p-value.
    """
    tested: dict[tuple[str, str], tuple[Paired, tuple[Flip, ...]]] = {}
    for key, g in groups.items():
        a = np.array([x.mean for x in g.before], dtype=float)
        b = np.array([y.mean for y in g.after], dtype=float)
        single = all(
            x.samples == 1 and y.samples == 1 for x, y in zip(g.before, g.after, strict=True)
        )
        paired = paired_comparison(
            a, b, single_sample=single, level=level, n_resamples=n_resamples, seed=seed
        )
        flips = tuple(
            Flip(y.task_id, y.domain, key[1], ma, mb, x.episode_ids, y.episode_ids)
            for x, y, ma, mb in sorted(
                zip(g.before, g.after, a, b, strict=True), key=lambda t: t[1].task_id
            )
            if solved(ma) != solved(mb)
        )
        tested[key] = (paired, flips)
    domains_of: dict[str, set[str]] = defaultdict(set)
    for d, m in groups:
        if d != ALL:
            domains_of[m].add(d)
    family = [
        k
        for k in tested
        if tested[k][0].p_value is not None and (k[0] != ALL or len(domains_of[k[1]]) != 1)
    ]
    adjusted = dict(zip(family, holm([tested[k][0].p_value for k in family]), strict=True))  # type: ignore[misc]
    for (d, m), _ in tested.items():
        if d == ALL and len(domains_of[m]) == 1 and (next(iter(domains_of[m])), m) in adjusted:
            adjusted[(d, m)] = adjusted[(next(iter(domains_of[m])), m)]
    rows = []
    for key in sorted(tested, key=lambda k: (k[1], k[0] == ALL, k[0])):
        paired, flips = tested[key]
        g = groups[key]
        p_adj = adjusted.get(key)
        rows.append(
            ComparisonRow(
                domain=key[0],
                mode=key[1],
                paired=paired,
                p_adjusted=p_adj,
                significant=p_adj is not None and p_adj < alpha,
                flips=flips,
                unmatched=g.unmatched,
                infra_a=g.infra_a,
                infra_b=g.infra_b,
            )
        )
    return rows


def _add(
    groups: dict[tuple[str, str], _Group],
    domain: str,
    label: str,
    a: TaskResult | None,
    b: TaskResult | None,
) -> None:
    for key in ((domain, label), (ALL, label)):
        g = groups[key]
        g.infra_a += a.infra if a else 0
        g.infra_b += b.infra if b else 0
        if a is not None and b is not None and a.mean is not None and b.mean is not None:
            g.before.append(a)
            g.after.append(b)
        else:
            g.unmatched += 1


def compare_runs(
    before: Iterable[Outcome],
    after: Iterable[Outcome],
    *,
    alpha: float = DEFAULT_ALPHA,
    level: float = DEFAULT_LEVEL,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> list[ComparisonRow]:
    """`after` (e.g. tonight) against `before` on the same task set, per domain x mode.

    Tasks are matched by (mode, task id); the caller makes sure both runs ran the same
    task set (same content hash): task ids alone do not say that.
    """
    a, b = task_results(before), task_results(after)
    groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        domain = (y or x).domain  # type: ignore[union-attr]
        _add(groups, domain, key[0], x, y)
    return _rows(groups, alpha=alpha, level=level, n_resamples=n_resamples, seed=seed)


def compare_modes(
    outcomes: Iterable[Outcome],
    *,
    a: str = "llm",
    b: str = "sandbox",
    alpha: float = DEFAULT_ALPHA,
    level: float = DEFAULT_LEVEL,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> list[ComparisonRow]:
    """Mode `b` against mode `a` of one run, matched by task id (mode label "b vs a").

    Only tasks run in both modes count; a run of one mode gives no rows.
    """
    results = task_results(outcomes)
    tasks_a = {t: r for (m, t), r in results.items() if m == a}
    tasks_b = {t: r for (m, t), r in results.items() if m == b}
    if not tasks_a or not tasks_b:
        return []
    label = f"{b} vs {a}"
    groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
    for task in sorted(set(tasks_a) | set(tasks_b)):
        x, y = tasks_a.get(task), tasks_b.get(task)
        _add(groups, (y or x).domain, label, x, y)  # type: ignore[union-attr]
    return _rows(groups, alpha=alpha, level=level, n_resamples=n_resamples, seed=seed)


def regressions(rows: Iterable[ComparisonRow]) -> list[ComparisonRow]:
    """The significant drops (after Holm), e.g. for --fail-on-regression."""
    return [r for r in rows if r.is_regression]


def describe_change(r: ComparisonRow) -> str:
    """One sentence: 'math / llm: 91.7% -> 25.0% (-66.7 pts, 95% CI -88.9 to -41.7; p = 0.043 Holm-adjusted, 9 tasks down, 1 up)'."""
    p = r.paired
    d = p.diff.scaled(100)
    ci = (
        f", {round(p.diff.level * 100)}% CI {d['low']:+.1f} to {d['high']:+.1f}"
        if d["low"] is not None
        else ""
    )
    down = sum(f.direction == "down" for f in r.flips)
    up = sum(f.direction == "up" for f in r.flips)
    return (
        f"{r.domain} / {r.mode}: {100 * (p.mean_a or 0):.1f}% -> {100 * (p.mean_b or 0):.1f}% "
        f"({d['estimate']:+.1f} pts{ci}; p = {_round_p(r.p_adjusted)} Holm-adjusted, {p.test}; "
        f"{down} task(s) down, {up} up, over {p.n_tasks} tasks)"
    )


# ----------------------------------------------------------------------------- flaky
@dataclass(frozen=True)
class Night:
    """One run of a series, oldest first: its id, image identity and outcomes."""

    run_id: str
    image: str | None
    results: Mapping[tuple[str, str], TaskResult]


@dataclass(frozen=True)
class Flaky:
    task_id: str
    domain: str
    mode: str
    runs: int  # nights with an outcome for the task
    solved_runs: int
    comparable: int  # consecutive pairs of nights on the same image
    flips: int
    last_run_id: str

    @property
    def flip_rate(self) -> float:
        return self.flips / self.comparable if self.comparable else 0.0


def flaky_tasks(nights: Sequence[Night]) -> list[Flaky]:
    """Tasks whose outcome (solved or not) flipped between consecutive nights that ran on
    the same image (the model is the same within a series by definition); most flips first.

    A night where the task has no outcome (infra failures only) is skipped: the task's
    next outcome is compared with its last one.
    """
    history: dict[tuple[str, str], list[tuple[Night, TaskResult]]] = defaultdict(list)
    for night in nights:
        for key, res in night.results.items():
            if res.mean is not None:
                history[key].append((night, res))
    out = []
    for (mode, task), seq in history.items():
        comparable = flips = 0
        for (n0, r0), (n1, r1) in zip(seq, seq[1:], strict=False):
            if n0.image != n1.image:
                continue
            comparable += 1
            flips += solved(r0.mean) != solved(r1.mean)  # type: ignore[arg-type]
        if flips:
            out.append(
                Flaky(
                    task_id=task,
                    domain=seq[-1][1].domain,
                    mode=mode,
                    runs=len(seq),
                    solved_runs=sum(solved(r.mean) for _, r in seq),  # type: ignore[arg-type]
                    comparable=comparable,
                    flips=flips,
                    last_run_id=seq[-1][0].run_id,
                )
            )
    out.sort(key=lambda f: (-f.flips, f.mode, f.task_id))
    return out
