"""The estimators against hand-computed values, and intervals against their promise.

Coverage tests simulate many benchmarks with a known truth and count how often the
95% interval holds it. Each has a control that runs the same check on a broken variant
(samples treated as independent tasks): it must fail the same bounds, so the test can
tell a correct implementation from a broken one.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from analysis import statistics as st


# ------------------------------------------------------------------------ McNemar
@pytest.mark.parametrize(
    ("worsened", "improved", "expected"),
    [
        # 2 * P(X <= min) for X ~ Binomial(b + c, 1/2), by hand:
        (1, 7, 2 * (1 + 8) / 2**8),  # 0.0703125
        (0, 6, 2 * 1 / 2**6),  # 0.03125
        (2, 10, 2 * (1 + 12 + 66) / 2**12),  # 0.0385742...
        (9, 1, 2 * (1 + 10) / 2**10),  # 0.021484375
        (3, 3, 1.0),  # 2 * (1 + 6 + 15 + 20) / 64 > 1: capped
        (0, 0, 1.0),  # nothing changed
    ],
)
def test_mcnemar_exact_by_hand(worsened: int, improved: int, expected: float) -> None:
    assert st.mcnemar_exact(worsened, improved) == pytest.approx(expected, rel=1e-12)
    assert st.sign_test(improved, worsened) == pytest.approx(expected, rel=1e-12)


def test_paired_binary_uses_mcnemar_and_counts_discordant_tasks() -> None:
    before = [1] * 11 + [0]
    after = [0] * 9 + [1, 1, 1]  # 9 tasks worsened, 1 improved, 2 stayed solved
    p = st.paired_comparison(before, after, single_sample=True)
    assert (p.worsened, p.improved, p.n_tasks) == (9, 1, 12)
    assert p.test == "mcnemar-exact" and p.p_value == pytest.approx(2 * 11 / 1024)
    assert p.diff.estimate == pytest.approx(-8 / 12)
    assert p.diff.low is not None and p.diff.high is not None
    assert p.diff.low <= -8 / 12 <= p.diff.high < 0
    # several samples per task (or scores): the sign test on per-task differences
    q = st.paired_comparison([0.5, 1.0, 0.25], [0.75, 0.5, 0.25], single_sample=False)
    assert q.test == "sign-test" and (q.improved, q.worsened) == (1, 1) and q.p_value == 1.0


def test_paired_without_any_change_still_has_an_honest_interval() -> None:
    p = st.paired_comparison([1, 0, 1, 1, 0] * 4, [1, 0, 1, 1, 0] * 4)
    assert p.diff.estimate == 0 and p.p_value == 1.0
    # Wilson's upper limit for 0 changed out of 20: z^2 / (n + z^2)
    z2 = 1.959963984540054**2
    assert p.diff.high == pytest.approx(z2 / (20 + z2), rel=1e-6) and p.diff.low == -p.diff.high


# ------------------------------------------------------------------------ pass@k
@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (3, 0, 3, 0.0),
        (4, 3, 2, 1.0),  # n - c < k: every k-subset holds a pass
        (200, 1, 100, 0.5),  # 1 - C(199,100)/C(200,100) = 1 - 100/200
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert st.pass_at_k([n], [c], k)[0] == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_chance_that_k_of_the_samples_hold_a_pass() -> None:
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                exact = sum(any(s) for s in subsets) / len(subsets)
                assert st.pass_at_k([n], [c], k)[0] == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_curve_over_tasks_with_enough_samples() -> None:
    # task a: 1 of 4 passed; b: 0 of 4; c: 2 of 2
    tasks = ["a"] * 4 + ["b"] * 4 + ["c"] * 2
    passed = [1, 0, 0, 0] + [0, 0, 0, 0] + [1, 1]
    curve = {p.k: p for p in st.pass_at_k_curve(tasks, passed)}
    assert sorted(curve) == [1, 2, 3, 4]
    assert curve[1].pass_at_k.estimate == pytest.approx((0.25 + 0 + 1) / 3)
    assert curve[2].pass_at_k.estimate == pytest.approx((0.5 + 0 + 1) / 3)
    assert curve[3].tasks == 2 and curve[3].pass_at_k.estimate == pytest.approx((0.75 + 0) / 2)
    assert curve[4].pass_at_k.estimate == pytest.approx(0.5)
    assert curve[1].mean_at_k.estimate == pytest.approx((0.25 + 0 + 1) / 3)


def test_bad_input_names_the_problem() -> None:
    with pytest.raises(ValueError, match=r"task 1: n = 2, c = 3"):
        st.pass_at_k([4, 2], [1, 3], 1)
    with pytest.raises(ValueError, match="k = 0"):
        st.pass_at_k([4], [1], 0)
    with pytest.raises(ValueError, match="2 task ids but 3 scores"):
        st.mean_interval([1, 0, 1], ["a", "b"])
    with pytest.raises(ValueError, match="NaN"):
        st.paired_comparison([1.0, float("nan")], [1.0, 0.0])


# ------------------------------------------------------------------ SE and intervals
def test_clustered_se_is_the_usual_se_with_one_sample_per_task() -> None:
    x = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=float)
    assert st.clustered_se(x, np.ones_like(x)) == pytest.approx(x.std(ddof=1) / math.sqrt(x.size))
    assert st.clustered_se([1.0], [1.0]) is None


def test_all_correct_gets_a_wilson_interval_not_certainty() -> None:
    iv = st.mean_interval([1.0] * 12, [f"t{i}" for i in range(12)])
    assert iv.estimate == 1.0 and iv.high == pytest.approx(1.0)
    z2 = 1.959963984540054**2
    assert iv.low == pytest.approx(12 / (12 + z2), rel=1e-6)  # Wilson's lower limit at 12/12
    assert iv.method.startswith("wilson")
    assert st.mean_interval([], []).estimate is None
    one = st.mean_interval([1.0, 0.0], ["t", "t"])
    assert one.estimate == 0.5 and one.low is None and one.method == "too few tasks"


def _clustered_benchmark(
    rng: np.random.Generator, tasks: int, samples: int
) -> tuple[np.ndarray, list[str]]:
    """Tasks of very different difficulty (Beta(0.3, 0.3): mostly near 0 or 1), mean 0.5."""
    p = rng.beta(0.3, 0.3, size=tasks)
    scores = (rng.random((tasks, samples)) < p[:, None]).astype(float).ravel()
    ids = [f"t{i}" for i in range(tasks) for _ in range(samples)]
    return scores, ids


def _coverage(sims: int, truth: float, make, interval) -> float:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(20260122)
    hits = 0
    for i in range(sims):
        scores, ids = make(rng)
        iv = interval(scores, ids, i)
        hits += iv.low <= truth <= iv.high
    return hits / sims


def test_clustered_interval_covers_the_truth_and_a_naive_one_does_not() -> None:
    make = lambda rng: _clustered_benchmark(rng, tasks=40, samples=4)  # noqa: E731
    good = _coverage(
        300, 0.5, make, lambda s, ids, i: st.mean_interval(s, ids, n_resamples=1000, seed=i)
    )
    assert 0.90 <= good <= 0.985, good
    # Control: the same data with every sample treated as its own task (a broken,
    # unclustered bootstrap) must fail the same bounds, or this test proves nothing.
    naive = _coverage(
        300, 0.5, make,
        lambda s, ids, i: st.mean_interval(s, [str(j) for j in range(len(s))], n_resamples=1000, seed=i),
    )  # fmt: skip
    assert naive < 0.85, naive


def test_single_sample_interval_covers_a_binomial_proportion() -> None:
    def make(rng: np.random.Generator) -> tuple[np.ndarray, list[str]]:
        return (rng.random(60) < 0.3).astype(float), [f"t{i}" for i in range(60)]

    cov = _coverage(
        400, 0.3, make, lambda s, ids, i: st.mean_interval(s, ids, n_resamples=1000, seed=i)
    )
    assert 0.90 <= cov <= 0.985, cov


def test_paired_difference_interval_covers_the_true_change() -> None:
    rng = np.random.default_rng(7)
    hits = flagged = 0
    sims = 300
    for i in range(sims):
        p = rng.uniform(0.1, 0.8, size=80)
        before = (rng.random(80) < p).astype(float)
        after = (rng.random(80) < p + 0.1).astype(float)  # the model got 10 points better
        r = st.paired_comparison(before, after, n_resamples=1000, seed=i)
        hits += r.diff.low <= 0.1 <= r.diff.high  # type: ignore[operator]
        # no change at all: the test must flag it about 5% of the time, no more
        same = (rng.random(80) < p).astype(float)
        flagged += st.paired_comparison(before, same, n_resamples=200, seed=i).p_value < 0.05  # type: ignore[operator]
    assert 0.90 <= hits / sims <= 0.985, hits / sims
    assert flagged / sims <= 0.07, flagged / sims


def test_holm_matches_the_step_down_by_hand() -> None:
    # sorted: 0.01 * 3 = 0.03; 0.03 * 2 = 0.06; max(0.06, 0.04 * 1) = 0.06
    assert st.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert st.holm([]) == []


def test_pass_at_k_says_which_tasks_lack_samples() -> None:
    """Issue #22: a k above the sample count was dropped without a word."""
    tasks = ["a"] * 3 + ["b"]
    curve = {p.k: p for p in st.pass_at_k_curve(tasks, [1, 0, 0, 1], ks=[1, 2, 5])}
    assert sorted(curve) == [1, 2, 5]
    assert curve[1].tasks == 2 and curve[1].left_out == 0 and curve[1].note is None
    assert curve[2].tasks == 1 and curve[2].left_out == 1
    assert "1 of 2 tasks have fewer than 2 samples (as few as 1)" in str(curve[2].note)
    assert curve[5].tasks == 0 and curve[5].pass_at_k.estimate is None
    assert "no task has 5 samples (the most any task has is 3)" in str(curve[5].note)
