"""Estimators a nightly benchmark can trust: intervals, pass@k, paired tests.

Why these choices (docs/statistics.md says more, and when not to trust each):

- The unit of resampling is the *task*, not the episode. Several samples of one task
  are correlated (an easy task is easy every time), so treating them as independent
  understates the uncertainty; every interval here resamples whole tasks (a cluster
  bootstrap), and every standard error is the cluster-robust one.
- Intervals are BCa bootstrap intervals (scipy.stats.bootstrap). When every task has
  the same outcome the bootstrap has nothing to resample and would claim certainty;
  then a Wilson interval on the task count (statsmodels) is used for 0/1 outcomes.
- pass@k is the unbiased estimator of Chen et al. (2021): 1 - C(n-c, k) / C(n, k) per
  task, averaged over tasks; mean@k is the mean score of the task's samples.
- A paired comparison matches tasks. With one 0/1 outcome per task on each side the
  test is the exact McNemar test (statsmodels); otherwise the exact sign test on the
  per-task differences (scipy), which is McNemar's test generalised to scores. Both
  only count the tasks that changed; their p-values agree with the SQL views'.
- Several comparisons at once (domains x modes) are corrected with Holm's method.

Everything is a pure function of its arguments (NumPy arrays or sequences); random
resampling is seeded, so a report is reproducible.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike, NDArray

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 2000
SOLVED_AT = 0.5  # a task counts as solved when its mean score is at least this


@dataclass(frozen=True)
class Interval:
    """An estimate with its standard error and confidence interval.

    `method` says how the interval was obtained ("bootstrap-bca", "wilson", ...);
    `low`/`high` are None when there is too little data for any interval.
    """

    estimate: float | None
    se: float | None
    low: float | None
    high: float | None
    n_tasks: int
    n_samples: int
    method: str
    level: float = DEFAULT_LEVEL

    def scaled(self, factor: float, ndigits: int = 1) -> dict[str, float | None]:
        """estimate / se / low / high multiplied (e.g. by 100 for percent) and rounded."""

        def r(v: float | None) -> float | None:
            return None if v is None else round(v * factor, ndigits)

        return {
            "estimate": r(self.estimate),
            "se": r(self.se),
            "low": r(self.low),
            "high": r(self.high),
        }

    def columns(self, factor: float, **names: str) -> dict[str, float | None]:
        """Values of `scaled(factor)` under a table's own column names, in the order named:
        columns(100, estimate="diff", low="diff_low", high="diff_high")."""
        values = self.scaled(factor)
        return {column: values[key] for key, column in names.items()}


# ------------------------------------------------------------------------ grouping
def group_by_task(
    task_ids: Sequence[str], scores: ArrayLike
) -> tuple[list[str], NDArray[np.float64], NDArray[np.float64]]:
    """Per task: (task ids, sum of scores, number of samples); NaN scores are left out."""
    values = np.asarray(scores, dtype=float)
    if len(task_ids) != len(values):
        raise ValueError(f"{len(task_ids)} task ids but {len(values)} scores")
    keep = ~np.isnan(values)
    ids = np.asarray(task_ids, dtype=object)[keep]
    values = values[keep]
    if values.size == 0:
        return [], np.zeros(0), np.zeros(0)
    tasks, inverse = np.unique(ids.astype(str), return_inverse=True)
    sums = np.bincount(inverse, weights=values, minlength=len(tasks)).astype(np.float64)
    counts = np.bincount(inverse, minlength=len(tasks)).astype(np.float64)
    return [str(t) for t in tasks], sums, counts


def clustered_se(sums: ArrayLike, counts: ArrayLike) -> float | None:
    """Cluster-robust standard error of the pooled mean sum(sums) / sum(counts).

    The ratio estimator's linearised variance with the small-sample factor T/(T-1):
    with one sample per task it is exactly the usual s / sqrt(n). None below 2 tasks.
    """
    s = np.asarray(sums, dtype=float)
    n = np.asarray(counts, dtype=float)
    t = s.size
    total = n.sum()
    if t < 2 or total <= 0:
        return None
    p = s.sum() / total
    resid = s - p * n
    return float(math.sqrt(t / (t - 1) * float((resid**2).sum())) / total)


def wilson(successes: int, n: int, level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (statsmodels)."""
    from statsmodels.stats.proportion import proportion_confint

    low, high = proportion_confint(successes, n, alpha=1 - level, method="wilson")
    return float(max(0.0, low)), float(min(1.0, high))


def _z(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2)


def _is_binary(values: NDArray[np.float64]) -> bool:
    return bool(np.all((values == 0.0) | (values == 1.0)))


def _bootstrap(
    data: tuple[NDArray[np.float64], ...],
    statistic: Callable[..., NDArray[np.float64]],
    level: float,
    n_resamples: int,
    seed: int,
) -> tuple[float, float, str]:
    """BCa interval over the rows of `data` (paired arrays, one entry per task).

    Falls back to the percentile interval when BCa is undefined (e.g. a jackknife with
    no spread), so an interval is always returned for at least two distinct tasks.
    """
    from scipy.stats import bootstrap

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = bootstrap(
                data,
                statistic,
                paired=True,
                vectorized=True,
                confidence_level=level,
                n_resamples=n_resamples,
                method=method,
                rng=np.random.default_rng(seed),
            )
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(low) and math.isfinite(high):
            return low, high, f"bootstrap-{method.lower()}"
    return math.nan, math.nan, "bootstrap-failed"


def _ratio(s: NDArray[np.float64], n: NDArray[np.float64], axis: int = -1) -> NDArray[np.float64]:
    return np.asarray(s.sum(axis=axis) / n.sum(axis=axis))


def _mean(d: NDArray[np.float64], axis: int = -1) -> NDArray[np.float64]:
    return np.asarray(d.mean(axis=axis))


# ------------------------------------------------------------------------ intervals
def mean_interval(
    scores: ArrayLike,
    task_ids: Sequence[str],
    *,
    level: float = DEFAULT_LEVEL,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Mean score (e.g. accuracy) with a task-clustered SE and bootstrap interval.

    `scores[i]` is one sample of task `task_ids[i]` (NaN: not scored, left out). The
    estimate pools all samples (what an accuracy table shows); the bootstrap resamples
    whole tasks with all their samples.
    """
    tasks, sums, counts = group_by_task(task_ids, scores)
    n_samples = int(counts.sum())
    t = len(tasks)
    if t == 0:
        return Interval(None, None, None, None, 0, 0, "no data", level)
    estimate = float(sums.sum() / counts.sum())
    se = clustered_se(sums, counts)
    means = sums / counts
    if np.allclose(means, means[0]):
        # Every task alike (or a single task): nothing for a bootstrap to vary. For 0/1
        # outcomes the Wilson interval over the tasks still says how far from 0% / 100%
        # the truth may be.
        if _is_binary(np.round(means, 12)):
            low, high = wilson(int(round(means.sum())), t, level)
            return Interval(
                estimate, se, low, high, t, n_samples, "wilson (all tasks alike)", level
            )
        if t < 2:
            return Interval(estimate, None, None, None, t, n_samples, "too few tasks", level)
        return Interval(
            estimate, se, estimate, estimate, t, n_samples, "degenerate (all tasks alike)", level
        )
    low, high, method = _bootstrap((sums, counts), _ratio, level, n_resamples, seed)
    return Interval(estimate, se, low, high, t, n_samples, method, level)


# ---------------------------------------------------------------------------- pass@k
def pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> NDArray[np.float64]:
    """Unbiased pass@k per task: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021).

    `n` samples of which `c` passed; needs 1 <= k <= n. Computed as a product (no large
    binomials): C(n-c, k) / C(n, k) = prod_{i=0}^{k-1} (n-c-i) / (n-i).
    """
    n_arr = np.atleast_1d(np.asarray(n, dtype=np.int64))
    c_arr = np.atleast_1d(np.asarray(c, dtype=np.int64))
    if n_arr.shape != c_arr.shape:
        raise ValueError(f"n has shape {n_arr.shape} but c has {c_arr.shape}")
    if k < 1:
        raise ValueError(f"k = {k}: must be at least 1")
    bad = (c_arr < 0) | (c_arr > n_arr) | (n_arr < k)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"task {i}: n = {n_arr[i]}, c = {c_arr[i]}, k = {k}: need 0 <= c <= n and n >= k"
        )
    out = np.ones(n_arr.shape, dtype=float)
    steps = np.arange(k)
    for i, (ni, ci) in enumerate(zip(n_arr, c_arr, strict=True)):
        if ni - ci >= k:
            out[i] = 1.0 - float(np.prod((ni - ci - steps) / (ni - steps)))
    return out


@dataclass(frozen=True)
class PassAtK:
    k: int
    tasks: int  # tasks with at least k samples (the ones the estimate is over)
    pass_at_k: Interval
    mean_at_k: Interval
    left_out: int = 0  # tasks with fewer than k samples: not in the estimate
    note: str | None = None  # why tasks were left out, naming the sample counts


def _left_out_note(k: int, n: NDArray[np.int64], use: NDArray[np.bool_]) -> str | None:
    """The sentence a pass@k row carries when tasks have fewer than k samples."""
    if use.all():
        return None
    most = int(n.max())
    if not use.any():
        return (f"no task has {k} samples (the most any task has is {most}): pass@{k} needs at "
                f"least {k} samples per task")
    fewer = int((~use).sum())
    return (f"{fewer} of {len(n)} tasks have fewer than {k} samples (as few as {int(n.min())}) and "
            f"are left out: pass@{k} needs at least {k} samples per task")


def pass_at_k_curve(
    task_ids: Sequence[str],
    passed: ArrayLike,
    scores: ArrayLike | None = None,
    *,
    ks: Sequence[int] | None = None,
    level: float = DEFAULT_LEVEL,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> list[PassAtK]:
    """pass@k and mean@k for k = 1 .. the most samples any task has (or `ks`).

    At each k only tasks with at least k samples count (the estimator needs n >= k); such
    a row says how many tasks it left out and why (`left_out`, `note`). A k in `ks` that no
    task has samples for gives a row with no estimate and a note naming the sample counts,
    never silence. Intervals resample tasks. `scores` (default: `passed` as 0/1) gives mean@k.
    """
    ok = np.asarray(passed, dtype=float)
    sc = ok if scores is None else np.asarray(scores, dtype=float)
    tasks, c, n = group_by_task(task_ids, ok)
    _, score_sums, score_n = group_by_task(task_ids, sc)
    if not tasks:
        return []
    n_int = n.astype(np.int64)
    c_int = np.round(c).astype(np.int64)
    wanted = list(ks) if ks is not None else list(range(1, int(n_int.max()) + 1))
    out = []
    for k in wanted:
        if k < 1:
            raise ValueError(f"k = {k}: must be at least 1")
        use = n_int >= k
        note = _left_out_note(k, n_int, use)
        if not use.any():
            none = Interval(None, None, None, None, 0, 0, "no task has enough samples", level)
            out.append(PassAtK(k=k, tasks=0, pass_at_k=none, mean_at_k=none, left_out=len(tasks), note=note))
            continue
        ids = [t for t, u in zip(tasks, use, strict=True) if u]
        values = pass_at_k(n_int[use], c_int[use], k)
        means = (score_sums / np.maximum(score_n, 1))[use]
        out.append(
            PassAtK(
                k=k,
                tasks=len(ids),
                pass_at_k=mean_interval(
                    values, ids, level=level, n_resamples=n_resamples, seed=seed
                ),
                mean_at_k=mean_interval(
                    means, ids, level=level, n_resamples=n_resamples, seed=seed
                ),
                left_out=len(tasks) - len(ids),
                note=note,
            )
        )
    return out


# ------------------------------------------------------------------- paired tests
def mcnemar_exact(worsened: int, improved: int) -> float:
    """Two-sided exact McNemar p-value from the two discordant counts (statsmodels)."""
    from statsmodels.stats.contingency_tables import mcnemar

    if worsened < 0 or improved < 0:
        raise ValueError(f"discordant counts must be >= 0, got {worsened} and {improved}")
    if worsened + improved == 0:
        return 1.0
    return float(min(1.0, mcnemar([[0, worsened], [improved, 0]], exact=True).pvalue))


def sign_test(improved: int, worsened: int) -> float:
    """Two-sided exact sign test (ties dropped) on paired differences (scipy)."""
    from scipy.stats import binomtest

    n = improved + worsened
    if n == 0:
        return 1.0
    return float(binomtest(improved, n, 0.5).pvalue)


@dataclass(frozen=True)
class Paired:
    """A paired comparison of B against A on the same tasks (diff = B - A)."""

    n_tasks: int
    mean_a: float | None
    mean_b: float | None
    diff: Interval
    improved: int  # tasks where B scored higher
    worsened: int  # tasks where B scored lower
    test: str | None  # "mcnemar-exact" | "sign-test"; None without matched tasks
    p_value: float | None


def paired_comparison(
    a: ArrayLike,
    b: ArrayLike,
    *,
    single_sample: bool = True,
    level: float = DEFAULT_LEVEL,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Paired:
    """Compare per-task scores `b` with `a` (same tasks, same order).

    `a[i]`, `b[i]` are task i's mean score on each side. With 0/1 values and
    `single_sample` (one sample per task on both sides) the test is the exact McNemar
    test, else the exact sign test. The difference's interval resamples tasks (paired
    BCa bootstrap); when no task changed at all, the bound comes from the Wilson upper
    limit of the share of tasks that could have changed unseen.
    """
    va = np.asarray(a, dtype=float)
    vb = np.asarray(b, dtype=float)
    if va.shape != vb.shape or va.ndim != 1:
        raise ValueError(
            f"paired scores must be two 1-d arrays of one length, got {va.shape} and {vb.shape}"
        )
    if np.isnan(va).any() or np.isnan(vb).any():
        raise ValueError("paired scores contain NaN: match tasks scored on both sides first")
    n = int(va.size)
    if n == 0:
        return Paired(
            0,
            None,
            None,
            Interval(None, None, None, None, 0, 0, "no data", level),
            0,
            0,
            None,
            None,
        )
    d = vb - va
    improved = int((d > 0).sum())
    worsened = int((d < 0).sum())
    binary = _is_binary(va) and _is_binary(vb)
    if binary and single_sample:
        test, p = "mcnemar-exact", mcnemar_exact(worsened, improved)
    else:
        test, p = "sign-test", sign_test(improved, worsened)
    est = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    if n < 2:
        diff = Interval(est, None, None, None, n, n, "too few tasks", level)
    elif np.allclose(d, d[0]):
        if improved == worsened == 0:
            bound = wilson(0, n, level)[1]
            diff = Interval(est, se, -bound, bound, n, n, "no task changed (wilson bound)", level)
        else:
            diff = Interval(est, se, est, est, n, n, "degenerate (every task changed alike)", level)
    else:
        low, high, method = _bootstrap((d,), _mean, level, n_resamples, seed)
        diff = Interval(est, se, low, high, n, n, method, level)
    return Paired(n, float(va.mean()), float(vb.mean()), diff, improved, worsened, test, p)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values (statsmodels), same order as given."""
    if not p_values:
        return []
    from statsmodels.stats.multitest import multipletests

    return [float(x) for x in multipletests(list(p_values), method="holm")[1]]


def solved(mean_score: float, threshold: float = SOLVED_AT) -> bool:
    """A task's outcome for flips: solved when its mean score reaches the threshold."""
    return mean_score >= threshold


def normal_interval(
    estimate: float, se: float, level: float = DEFAULT_LEVEL
) -> tuple[float, float]:
    """estimate +- z * se (the normal approximation; the SQL views give SE only)."""
    z = _z(level)
    return estimate - z * se, estimate + z * se
