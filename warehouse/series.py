"""Nightly lineage: runs as series, and the statistics views over them.

A *series* is the runs of one deployment (the `series` column of `runs`: a Prefect
deployment's name or `--series`; NULL for ad-hoc runs, which form their own series),
one task set (`dataset_hash`, its content hash) and one model. Within a series runs are
ordered by start; a run's *previous run* is the latest earlier one that ended
(`finished` or `failed`, not `running` / `interrupted`).

Views (registered by warehouse/query.py after the base views):

  episode_outcomes  one verdict per episode (its newest score; NULL for infra failures)
  run_series        one row per run x mode: lineage, accuracy with its task-clustered SE,
                    infra failures, tokens, speed
  nightly_diff      each run against its previous run, per domain x mode and overall:
                    paired on tasks, flips, exact test (McNemar / sign), Holm-adjusted,
                    `significant` at 0.05; infra failures counted apart
  flaky_tasks       tasks whose outcome flipped between consecutive nights on one image
  pass_at_k         unbiased pass@k and mean@k per run x domain x mode, k = 1..the run's
                    most samples per task; `tasks_left_out` and `note` name the tasks with
                    fewer than k samples (a group with none gets a row saying so)

The same numbers come from analysis/ in Python (the report); tests/analysis checks the
two agree. docs/statistics.md says what each number means and when not to trust it.

`read_series` and `read_trajectories` fetch what the nightly report section needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOLVED_AT = 0.5  # a task's outcome is "solved" when its mean score reaches this
ALPHA = 0.05  # `significant` in nightly_diff

# The exact two-sided binomial (p = 1/2) p-value of k = min(improved, worsened) out of
# n = improved + worsened changed tasks: McNemar's exact test (one 0/1 sample per task)
# or the sign test (scores or several samples). 2 * P(X <= k), at most 1.
_SIGN_P = """
    CASE WHEN {n} = 0 THEN 1.0 ELSE least(1.0, 2 * list_sum(list_transform(range({k} + 1),
        lambda i: exp(lgamma({n} + 1) - lgamma(i + 1) - lgamma({n} - i + 1) - {n} * ln(2)))))
    END
"""

SERIES_VIEWS: dict[str, str] = {
    "episode_outcomes": """
        WITH s AS (
            SELECT run_id, episode_id, verifier, score, passed FROM episode_score
        ), e AS (
            SELECT *, coalesce(is_infra_failure, false) OR termination IS NULL AS infra FROM episodes
        )
        SELECT e.run_id, e.episode_id, e.task_id, e.domain, e.mode, e.sample_index, e.model,
               e.termination, e.infra AS infra_failure, s.verifier,
               CASE WHEN NOT e.infra THEN s.score END AS score,
               CASE WHEN NOT e.infra THEN coalesce(s.passed, s.score >= 1.0) END AS passed,
               coalesce(e.prompt_tokens, 0) + coalesce(e.completion_tokens, 0) AS total_tokens,
               e.num_turns, e.wall_s
        FROM e LEFT JOIN s USING (run_id, episode_id)
    """,
    "run_series": """
        WITH r AS (
            SELECT *, coalesce(series, '(ad hoc)') AS series_name,
                   substr(md5(concat_ws('|', coalesce(series, ''),
                                        coalesce(dataset_hash, dataset, ''),
                                        coalesce(model, ''))), 1, 12) AS series_key,
                   coalesce(status IN ('finished', 'failed'), false) AS ended
            FROM runs
        ), l AS (
            SELECT *,
                   row_number() OVER (PARTITION BY series_key ORDER BY started_at, run_id) AS run_number,
                   last_value(CASE WHEN ended THEN run_id END IGNORE NULLS) OVER (
                       PARTITION BY series_key ORDER BY started_at, run_id
                       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS previous_run_id
            FROM r
        ), o AS (
            SELECT * FROM episode_outcomes
        ), per_task AS (
            SELECT run_id, mode, task_id, sum(score) AS s, count(score) AS n
            FROM o WHERE score IS NOT NULL GROUP BY ALL
        ), acc0 AS (
            SELECT run_id, mode, sum(s) / sum(n) AS p, CAST(sum(n) AS BIGINT) AS scored, count(*) AS tasks
            FROM per_task GROUP BY ALL
        ), acc AS (
            -- cluster-robust SE of the pooled mean (tasks are the clusters)
            SELECT a.run_id, a.mode, any_value(a.p) AS p, any_value(a.scored) AS scored,
                   any_value(a.tasks) AS tasks,
                   CASE WHEN any_value(a.tasks) > 1 THEN
                       sqrt(any_value(a.tasks) / (any_value(a.tasks) - 1)
                            * sum(power(t.s - a.p * t.n, 2))) / any_value(a.scored)
                   END AS se
            FROM acc0 a JOIN per_task t USING (run_id, mode)
            GROUP BY a.run_id, a.mode
        ), ep AS (
            SELECT run_id, mode, count(*) AS episodes,
                   count(*) FILTER (WHERE infra_failure) AS infra_failures,
                   avg(total_tokens) FILTER (WHERE NOT infra_failure) AS avg_tokens,
                   avg(num_turns) FILTER (WHERE NOT infra_failure) AS avg_turns,
                   avg(wall_s) FILTER (WHERE NOT infra_failure) AS avg_wall_s
            FROM o GROUP BY ALL
        )
        SELECT l.series_key, l.series_name AS series, l.dataset, l.dataset_hash, l.model,
               l.run_number, l.run_id, l.previous_run_id, l.started_at, l.ended_at, l.status,
               l.image, l.image_id,
               coalesce(l.image_id, l.image) IS DISTINCT FROM coalesce(p.image_id, p.image)
                   AND l.previous_run_id IS NOT NULL AS image_changed,
               coalesce(json_extract_string(l.config, '$.prompts'), '')
                   IS DISTINCT FROM coalesce(json_extract_string(p.config, '$.prompts'), '')
                   AND l.previous_run_id IS NOT NULL AS prompts_changed,
               ep.mode, ep.episodes, ep.infra_failures, acc.tasks, acc.scored,
               round(acc.p, 4) AS accuracy, round(acc.se, 4) AS accuracy_se,
               round(ep.avg_tokens, 1) AS avg_tokens, round(ep.avg_turns, 2) AS avg_turns,
               round(ep.avg_wall_s, 2) AS avg_wall_s,
               round(epoch(l.ended_at - l.started_at) / 60, 2) AS run_minutes
        FROM l LEFT JOIN l p ON p.run_id = l.previous_run_id
        LEFT JOIN ep ON ep.run_id = l.run_id
        LEFT JOIN acc ON acc.run_id = l.run_id AND acc.mode = ep.mode
        ORDER BY l.series_key, l.run_number, ep.mode
    """,
    "nightly_diff": f"""
        WITH pairs AS (
            SELECT DISTINCT series_key, series, dataset, model, run_id, previous_run_id, image_changed
            FROM run_series WHERE previous_run_id IS NOT NULL
        ), t AS (
            SELECT run_id, mode, task_id, any_value(domain) AS domain,
                   avg(score) AS m, count(score) AS n,
                   count(*) FILTER (WHERE infra_failure) AS infra
            FROM episode_outcomes GROUP BY run_id, mode, task_id
        ), cur AS (
            SELECT p.run_id AS pair_run, t.* EXCLUDE (run_id) FROM pairs p JOIN t ON t.run_id = p.run_id
        ), prev AS (
            SELECT p.run_id AS pair_run, t.* EXCLUDE (run_id) FROM pairs p JOIN t ON t.run_id = p.previous_run_id
        ), j AS (
            SELECT coalesce(c.pair_run, v.pair_run) AS run_id, coalesce(c.mode, v.mode) AS mode,
                   coalesce(c.domain, v.domain) AS domain, coalesce(c.task_id, v.task_id) AS task_id,
                   c.m, c.n, coalesce(c.infra, 0) AS infra,
                   v.m AS prev_m, v.n AS prev_n, coalesce(v.infra, 0) AS prev_infra,
                   c.m IS NOT NULL AND v.m IS NOT NULL AS matched
            FROM cur c FULL OUTER JOIN prev v
              ON c.pair_run = v.pair_run AND c.mode = v.mode AND c.task_id = v.task_id
        ), g AS (
            SELECT run_id, mode,
                   CASE WHEN grouping(domain) = 1 THEN '(all)' ELSE domain END AS domain,
                   count(*) FILTER (WHERE matched) AS tasks,
                   count(*) FILTER (WHERE NOT matched) AS unmatched_tasks,
                   CAST(sum(prev_infra) AS BIGINT) AS prev_infra_failures,
                   CAST(sum(infra) AS BIGINT) AS infra_failures,
                   avg(prev_m) FILTER (WHERE matched) AS prev_accuracy,
                   avg(m) FILTER (WHERE matched) AS accuracy,
                   avg(m - prev_m) FILTER (WHERE matched) AS diff,
                   stddev_samp(m - prev_m) FILTER (WHERE matched)
                       / sqrt(count(*) FILTER (WHERE matched)) AS diff_se,
                   count(*) FILTER (WHERE matched AND m > prev_m) AS improved,
                   count(*) FILTER (WHERE matched AND m < prev_m) AS worsened,
                   count(*) FILTER (WHERE matched AND prev_m >= {SOLVED_AT} AND m < {SOLVED_AT}) AS flips_down,
                   count(*) FILTER (WHERE matched AND prev_m < {SOLVED_AT} AND m >= {SOLVED_AT}) AS flips_up,
                   coalesce(list(task_id ORDER BY task_id)
                       FILTER (WHERE matched AND prev_m >= {SOLVED_AT} AND m < {SOLVED_AT}), []) AS tasks_down,
                   coalesce(list(task_id ORDER BY task_id)
                       FILTER (WHERE matched AND prev_m < {SOLVED_AT} AND m >= {SOLVED_AT}), []) AS tasks_up,
                   bool_and(n = 1 AND prev_n = 1 AND m IN (0, 1) AND prev_m IN (0, 1))
                       FILTER (WHERE matched) AS single_binary
            FROM j
            GROUP BY GROUPING SETS ((run_id, mode, domain), (run_id, mode))
        ), pv AS (
            SELECT *,
                   CASE WHEN tasks = 0 THEN NULL
                        ELSE {_SIGN_P.format(n="(improved + worsened)", k="least(improved, worsened)")}
                   END AS p_value,
                   -- the overall row of a single-domain mode repeats that domain's test:
                   -- it is not counted twice in the Holm family
                   domain <> '(all)' OR count(*) FILTER (WHERE domain <> '(all)')
                       OVER (PARTITION BY run_id, mode) <> 1 AS in_family
            FROM g
        ), ranked AS (
            SELECT run_id, mode, domain, p_value,
                   row_number() OVER (PARTITION BY run_id ORDER BY p_value, mode, domain) AS rk,
                   count(*) OVER (PARTITION BY run_id) AS family_size
            FROM pv WHERE in_family AND p_value IS NOT NULL
        ), holm AS (
            SELECT run_id, mode, domain,
                   max(least(1.0, (family_size - rk + 1) * p_value)) OVER (
                       PARTITION BY run_id ORDER BY rk
                       ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS p_adjusted
            FROM ranked
        ), adj AS (
            SELECT pv.*, coalesce(h.p_adjusted, h1.p_adjusted) AS p_adjusted
            FROM pv
            LEFT JOIN holm h ON h.run_id = pv.run_id AND h.mode = pv.mode AND h.domain = pv.domain
            LEFT JOIN holm h1 ON NOT pv.in_family AND h1.run_id = pv.run_id AND h1.mode = pv.mode
                 AND h1.domain <> '(all)'
        )
        SELECT p.series_key, p.series, p.dataset, p.model, a.run_id, p.previous_run_id,
               a.domain, a.mode, a.tasks,
               round(a.prev_accuracy, 4) AS prev_accuracy, round(a.accuracy, 4) AS accuracy,
               round(a.diff, 4) AS diff, round(a.diff_se, 4) AS diff_se,
               a.improved, a.worsened, a.flips_down, a.flips_up, a.tasks_down, a.tasks_up,
               CASE WHEN a.tasks = 0 THEN NULL
                    WHEN a.single_binary THEN 'mcnemar-exact' ELSE 'sign-test' END AS test,
               a.p_value, a.p_adjusted,
               coalesce(a.p_adjusted < {ALPHA}, false) AS significant,
               CASE WHEN NOT coalesce(a.p_adjusted < {ALPHA}, false) THEN 'none'
                    WHEN a.diff < 0 THEN 'down' ELSE 'up' END AS change,
               a.unmatched_tasks, a.prev_infra_failures, a.infra_failures, p.image_changed
        FROM adj a JOIN pairs p USING (run_id)
        ORDER BY p.series_key, a.run_id, a.mode, a.domain = '(all)', a.domain
    """,
    "flaky_tasks": f"""
        WITH t AS (
            SELECT run_id, mode, task_id, any_value(domain) AS domain, avg(score) >= {SOLVED_AT} AS solved
            FROM episode_outcomes WHERE score IS NOT NULL GROUP BY run_id, mode, task_id
        ), r AS (
            SELECT DISTINCT series_key, series, dataset, model, run_id, started_at,
                   coalesce(image_id, image) AS image_key
            FROM run_series
        ), l AS (
            SELECT r.*, t.mode, t.task_id, t.domain, t.solved,
                   lag(t.solved) OVER w AS prev_solved,
                   lag(r.image_key) OVER w AS prev_image,
                   row_number() OVER w AS night
            FROM t JOIN r USING (run_id)
            WINDOW w AS (PARTITION BY r.series_key, t.mode, t.task_id ORDER BY r.started_at, r.run_id)
        ), f AS (
            SELECT series_key, any_value(series) AS series, any_value(dataset) AS dataset,
                   any_value(model) AS model, mode, task_id, arg_max(domain, night) AS domain,
                   count(*) AS runs, count(*) FILTER (WHERE solved) AS solved_runs,
                   count(*) FILTER (WHERE night > 1 AND image_key IS NOT DISTINCT FROM prev_image)
                       AS comparable,
                   count(*) FILTER (WHERE night > 1 AND image_key IS NOT DISTINCT FROM prev_image
                                    AND solved <> prev_solved) AS flips,
                   arg_max(run_id, night) AS last_run_id, arg_max(solved, night) AS last_solved
            FROM l GROUP BY series_key, mode, task_id
        )
        SELECT *, round(flips / comparable, 3) AS flip_rate FROM f
        WHERE flips > 0
        ORDER BY flips DESC, series_key, mode, task_id
    """,
    "pass_at_k": """
        WITH t AS (
            SELECT run_id, any_value(model) AS model, domain, mode, task_id,
                   count(*) AS n, count(*) FILTER (WHERE passed) AS c, avg(score) AS mean_score
            FROM episode_outcomes WHERE score IS NOT NULL GROUP BY run_id, domain, mode, task_id
        ), ks AS (
            -- k = 1 .. the most samples any task of the run has: a domain x mode whose tasks
            -- have fewer still gets its rows, with no estimate and a note saying why
            SELECT run_id, unnest(range(1, max(n) + 1)) AS k FROM t GROUP BY run_id
        ), tk AS (
            -- unbiased pass@k of a task: 1 - C(n-c, k) / C(n, k); needs n >= k
            SELECT t.*, ks.k,
                   CASE WHEN t.n < ks.k THEN NULL
                        WHEN t.n - t.c < ks.k THEN 1.0
                        ELSE 1.0 - exp(lgamma(t.n - t.c + 1) - lgamma(t.n - t.c - ks.k + 1)
                                       - lgamma(t.n + 1) + lgamma(t.n - ks.k + 1))
                   END AS pass_k
            FROM t JOIN ks USING (run_id)
        ), g AS (
            SELECT run_id, any_value(model) AS model,
                   CASE WHEN grouping(domain) = 1 THEN '(all)' ELSE domain END AS domain, mode, k,
                   count(*) FILTER (WHERE n >= k) AS tasks,
                   count(*) FILTER (WHERE n < k) AS tasks_left_out,
                   min(n) AS min_samples, max(n) AS max_samples,
                   round(avg(pass_k), 6) AS pass_at_k,
                   round(stddev_samp(pass_k) / sqrt(count(pass_k)), 6) AS pass_at_k_se,
                   round(avg(mean_score) FILTER (WHERE n >= k), 6) AS mean_at_k,
                   round(stddev_samp(mean_score) FILTER (WHERE n >= k)
                         / sqrt(count(*) FILTER (WHERE n >= k)), 6) AS mean_at_k_se
            FROM tk
            GROUP BY GROUPING SETS ((run_id, domain, mode, k), (run_id, mode, k))
        )
        SELECT *,
               CASE WHEN tasks = 0 THEN format('no task has {} samples here (at most {}): pass@{} '
                                               'needs at least {} samples per task',
                                               k, max_samples, k, k)
                    WHEN tasks_left_out > 0 THEN format('{} of {} tasks have fewer than {} samples '
                                                        '(as few as {}) and are left out: pass@{} '
                                                        'needs at least {} samples per task',
                                                        tasks_left_out, tasks + tasks_left_out, k,
                                                        min_samples, k, k)
               END AS note
        FROM g
        ORDER BY run_id, mode, domain = '(all)', domain, k
    """,
}

SERIES_VIEW_HELP: dict[str, str] = {
    "episode_outcomes": "one verdict per episode: newest score, passed, infra failure (score NULL then)",
    "run_series": "one row per run x mode with its series, previous run, accuracy +- SE, infra failures, speed",
    "nightly_diff": "each run vs the previous run of its series: flips, exact test, Holm-adjusted, significant",
    "flaky_tasks": "tasks whose outcome flipped between nights of a series on the same image",
    "pass_at_k": "unbiased pass@k and mean@k per run x domain x mode, k = 1 .. the run's most samples per task; tasks_left_out and note say which tasks have fewer than k samples",
}


# ------------------------------------------------------------------------ readers
def _q(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _in(ids: list[str]) -> str:
    return "(" + ", ".join(_q(i) for i in ids) + ")" if ids else "(NULL)"


@dataclass
class SeriesData:
    """What the nightly report needs about a run's series (rows as dicts, oldest first)."""

    run_id: str
    series: dict[str, Any] = field(default_factory=dict)  # series_key, series, dataset, model
    previous_run_id: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)  # run_series rows of the window
    outcomes: list[dict[str, Any]] = field(default_factory=list)  # episode_outcomes rows
    usage: list[dict[str, Any]] = field(
        default_factory=list
    )  # run_id, capability, turns_with, turns
    # run_id, mode, task_id, episodes, cost_usd (NULL: some episode of the task is unpriced;
    # warehouse/cost.py's episode_cost, priced by each run's recorded table)
    cost: list[dict[str, Any]] = field(default_factory=list)


def read_series(root: Path | str, run_id: str, *, last: int = 14) -> SeriesData:
    """The run's series up to the run itself: its last `last` runs that ended (the run
    itself always included), their outcomes and sandbox capability usage."""
    from warehouse.query import WarehouseQuery

    out = SeriesData(run_id=run_id)
    with WarehouseQuery(root, tables=("runs", "episodes", "scores", "usage", "turns")) as q:
        me = q.arrow(
            "SELECT series_key, series, dataset, dataset_hash, model, run_number, previous_run_id "
            f"FROM run_series WHERE run_id = {_q(run_id)} LIMIT 1"
        ).to_pylist()
        if not me:
            return out
        row = me[0]
        out.series = {
            k: row[k] for k in ("series_key", "series", "dataset", "dataset_hash", "model")
        }
        out.previous_run_id = row["previous_run_id"]
        window = q.rows(
            "SELECT DISTINCT run_id, run_number FROM run_series "
            f"WHERE series_key = {_q(row['series_key'])} AND run_number <= {int(row['run_number'])} "
            f"AND (status IN ('finished', 'failed') OR run_id = {_q(run_id)}) "
            f"ORDER BY run_number DESC LIMIT {max(1, int(last))}"
        )
        ids = [r for r, _n in sorted(window, key=lambda x: x[1])]
        if out.previous_run_id and out.previous_run_id not in ids:
            ids.insert(0, out.previous_run_id)
        sel = _in(ids)
        out.runs = q.arrow(
            f"SELECT * FROM run_series WHERE run_id IN {sel} ORDER BY run_number, mode"
        ).to_pylist()
        out.outcomes = q.arrow(f"SELECT * FROM episode_outcomes WHERE run_id IN {sel}").to_pylist()
        out.usage = q.arrow(
            f"""
            WITH tot AS (
                SELECT run_id, CAST(sum(num_turns) AS BIGINT) AS turns FROM episodes
                WHERE mode = 'sandbox' AND run_id IN {sel} GROUP BY run_id
            ), u AS (
                SELECT DISTINCT u.run_id, u.episode_id, u.turn_index, u.capability
                FROM usage u JOIN episodes e USING (run_id, episode_id)
                WHERE e.mode = 'sandbox' AND u.capability <> 'none' AND u.run_id IN {sel}
            )
            SELECT u.run_id, u.capability, count(*) AS turns_with, any_value(tot.turns) AS turns
            FROM u JOIN tot USING (run_id) GROUP BY ALL ORDER BY u.run_id, u.capability
            """
        ).to_pylist()
        # what each task cost per run x mode (infra failures too: they were paid for)
        out.cost = q.arrow(
            f"""
            SELECT run_id, mode, task_id, count(*) AS episodes,
                   CASE WHEN count(cost_usd) < count(*) THEN NULL ELSE sum(cost_usd) END AS cost_usd
            FROM episode_cost WHERE run_id IN {sel}
            GROUP BY ALL ORDER BY run_id, mode, task_id
            """
        ).to_pylist()
    return out


# Bounds on what a report embeds of a trajectory (model output is untrusted and unbounded).
MAX_TURNS = 30
MAX_TEXT = 2000
MAX_OBSERVATION = 1500
MAX_CALLS = 4  # tool calls (and observations) shown per turn


def read_trajectories(
    root: Path | str, wanted: dict[str, list[str]], *, max_turns: int = MAX_TURNS
) -> dict[tuple[str, str], dict[str, Any]]:
    """(run_id, episode_id) -> the episode row (answer, termination, score) with its
    first `max_turns` turns; text fields cut to a bounded length before they are read."""
    from warehouse.query import WarehouseQuery

    out: dict[tuple[str, str], dict[str, Any]] = {}
    for run, episode_ids in wanted.items():
        if not episode_ids:
            continue
        with WarehouseQuery(root, run_id=run, tables=("episodes", "turns", "scores")) as q:
            sel = _in(sorted(set(episode_ids)))
            eps = q.arrow(
                f"""
                SELECT o.run_id, o.episode_id, o.task_id, o.domain, o.mode, o.sample_index,
                       o.termination, o.infra_failure, o.score, o.verifier,
                       left(e.answer, {MAX_TEXT}) AS answer, left(e.error, {MAX_TEXT}) AS error,
                       e.num_turns
                FROM episode_outcomes o JOIN episodes e USING (run_id, episode_id)
                WHERE o.episode_id IN {sel}
                """
            ).to_pylist()
            turns = q.arrow(
                f"""
                SELECT episode_id, turn_index,
                       left(assistant_content, {MAX_TEXT}) AS assistant_content,
                       left(reasoning_content, {MAX_TEXT}) AS reasoning_content,
                       list_transform(tool_calls[1:{MAX_CALLS}], lambda c: {{'name': left(c.name, 100),
                           'arguments': left(c.arguments, {MAX_TEXT})}}) AS tool_calls,
                       list_transform(observations[1:{MAX_CALLS}], lambda o: {{'content': left(o.content, {MAX_OBSERVATION}),
                           'exit_code': o.exit_code, 'timed_out': o.timed_out,
                           'error': left(o.error, 500)}}) AS observations
                FROM turns WHERE episode_id IN {sel} AND turn_index < {int(max_turns)}
                ORDER BY episode_id, turn_index
                """
            ).to_pylist()
        by_ep: dict[str, list[dict[str, Any]]] = {}
        for t in turns:
            by_ep.setdefault(t["episode_id"], []).append(t)
        for e in eps:
            e["turns"] = by_ep.get(e["episode_id"], [])
            out[(run, e["episode_id"])] = e
    return out


def read_outcomes(
    root: Path | str, run_ids: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs rows, episode_outcomes rows) of the given runs, for an ad-hoc comparison."""
    from warehouse.query import WarehouseQuery

    with WarehouseQuery(root, tables=("runs", "episodes", "scores")) as q:
        sel = _in(list(run_ids))
        runs = q.arrow(f"SELECT * FROM runs WHERE run_id IN {sel}").to_pylist()
        outcomes = q.arrow(f"SELECT * FROM episode_outcomes WHERE run_id IN {sel}").to_pylist()
    return runs, outcomes
