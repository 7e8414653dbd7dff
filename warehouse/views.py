"""Every view of the warehouse, in one place: its name, what it shows, its SQL.

Why a module of its own: the SQL that turns the stored files into answers is the part of
the warehouse people read and extend most, and it was spread through the query engine.
`warehouse/query.py` builds the session (files, validation, digests, the raw views
``_raw_<table>``, the current ``turns`` and ``partial_turns``) and then creates every
view of `VIEWS` in order; `sandflow sql` lists those with a help text, and so does the
viewer's SQL box.

Adding a view: append a `View` to the right group below (or a new group, listed in
`VIEWS`) after every view it reads; give it a `help` to list it, or a name starting with
``_`` to keep it internal. `tests/warehouse/test_query.py` checks that every listed view
exists on an empty warehouse. The statistics views (nightly lineage, pass@k) are their
own group in `warehouse/series.py`, next to the readers that use them.

One definition per idea: "an episode's verdict" is `episode_score` (its newest score,
any verifier); `accuracy`, `rl_steps`, `episode_outcomes` and the viewer read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from warehouse.cost import COST_VIEW_HELP, COST_VIEWS
from warehouse.data_views import DATA_VIEW_HELP, DATA_VIEWS
from warehouse.runlock import ABANDONED_NOTE
from warehouse.series import SERIES_VIEW_HELP, SERIES_VIEWS


@dataclass(frozen=True)
class View:
    """One view: `sql` is its SELECT (None: the session builds it from the files itself);
    `help` lists it in `sandflow sql` and the viewer (empty: an internal view)."""

    name: str
    sql: str | None
    help: str = ""



# The `turns` view's prompt_token_ids in full: a turn stored as a delta on the previous
# turn's prompt (prompt_token_ids_prefix_len set; warehouse.convert.prompt_id_deltas) gets
# the ids of its chain so far (the turns since the last one stored in full) concatenated.
# Only applied when a file of the snapshot holds deltas (its footer says so); queries that
# do not select prompt_token_ids skip the windows even then (DuckDB drops unused ones).
FULL_PROMPT_IDS = """
    SELECT * EXCLUDE (_prompt_chain) REPLACE (
        CASE WHEN prompt_token_ids_prefix_len IS NULL THEN prompt_token_ids
             ELSE flatten(list(prompt_token_ids) OVER (
                 PARTITION BY run_id, episode_id, write_id, _prompt_chain ORDER BY turn_index
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW))
        END AS prompt_token_ids)
    FROM (
        SELECT *, count(*) FILTER (WHERE prompt_token_ids_prefix_len IS NULL) OVER (
            PARTITION BY run_id, episode_id, write_id ORDER BY turn_index
            ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS _prompt_chain
        FROM ({body})
    )
"""

# A score `s` is stale when episode `e`'s current attempt is not the one it judged: it
# names another write_id, or (rows without one: older files) it predates the episode row.
_STALE_SCORE = """
    e.run_id = s.run_id AND e.episode_id = s.episode_id AND CASE
        WHEN s.episode_write_id IS NOT NULL THEN s.episode_write_id <> e.write_id
        ELSE coalesce(s.scored_at < e.written_at, false) END
"""


def _newest_batch(raw: str, labeller: str) -> str:
    """A label table (scores, usage) as it stands: per episode and `labeller` column, only
    the rows of the newest batch (re-scoring or re-labelling replaces a batch, never adds)."""
    return f"""
        SELECT * FROM {raw}
        QUALIFY batch_id = max(batch_id) OVER (PARTITION BY run_id, episode_id, {labeller})
    """


_NOTE = ABANDONED_NOTE.replace("'", "''")  # as a SQL string literal

# The current state (re-records and re-scores resolved) and the common questions.
BASE_VIEWS: tuple[View, ...] = (
    View(
        "runs",
        help="one row per run: model, image, dataset hash, config (no secrets), started/ended; "
        "a run recorded running whose process died shows as interrupted",
        sql=f"""
        SELECT * REPLACE (
            CASE WHEN abandoned THEN 'interrupted' ELSE status END AS status,
            CASE WHEN abandoned THEN concat_ws('; ', notes, '{_NOTE}') ELSE notes END
              AS notes)
        FROM (SELECT *, run_id IN (SELECT run_id FROM _abandoned_runs) AS abandoned FROM _raw_runs)
        QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY written_at DESC) = 1
    """,
    ),
    View(
        "episodes",
        help="one row per episode (latest attempt): task, domain, mode, termination, totals",
        sql="""
        SELECT * FROM _raw_episodes
        QUALIFY row_number() OVER (
            PARTITION BY run_id, episode_id ORDER BY written_at DESC, write_id DESC) = 1
    """,
    ),
    # built by the session from the files themselves (warehouse/query.py)
    View(
        "turns",
        help="one row per turn of the current attempts: messages, tool calls, observations, usage",
        sql=None,
    ),
    # Newest batch per (episode, verifier), minus stale scores: those of an attempt the
    # episode has since been re-recorded over (see _STALE_SCORE).
    View(
        "_scores_newest",
        sql=_newest_batch("_raw_scores", "verifier"),
    ),
    View(
        "scores",
        help="verifier scores (newest batch per episode x verifier; stale ones left out)",
        sql=f"""
        SELECT s.* FROM _scores_newest s
        WHERE NOT EXISTS (SELECT 1 FROM episodes e WHERE {_STALE_SCORE})
    """,
    ),
    # One verdict per episode: its newest current score, whatever the verifier (tasks of
    # one domain may use different verifiers). THE definition: accuracy, rl_steps,
    # episode_outcomes and the viewer all read it.
    View(
        "episode_score",
        help="one row per scored episode: its newest score (any verifier), passed, reason",
        sql="""
        SELECT * FROM scores
        QUALIFY row_number() OVER (
            PARTITION BY run_id, episode_id ORDER BY scored_at DESC, verifier) = 1
    """,
    ),
    View(
        "stale_scores",
        help="scores of an attempt since re-recorded (re-run the score flow to replace them)",
        sql=f"""
        SELECT s.*, e.write_id AS current_write_id, e.written_at AS rerecorded_at
        FROM _scores_newest s JOIN episodes e ON {_STALE_SCORE}
    """,
    ),
    View(
        "usage",
        help="capability labels per tool call (newest batch per episode x labeler)",
        sql=_newest_batch("_raw_usage", "labeler"),
    ),
    # built by the session from the files themselves (warehouse/query.py)
    View(
        "partial_turns",
        help="turns still in journals (live / orphaned / recovered episodes)",
        sql=None,
    ),
    # one row per request through the egress proxy, with the turn it ended in
    View(
        "egress",
        help=(
            "one row per request through the egress proxy (network allowlist/open): time, "
            "host, port, method, URL, status, bytes each way, allowed or denied with the rule, turn, "
            "cache_hit (served from the shared download cache); the firewall's refusals of direct "
            "connections too (method TCP/UDP, result FIREWALL_REFUSED)"
        ),
        sql="""
        SELECT run_id, episode_id, turn_index, unnest(e),
               coalesce(contains(e.result, 'HIT') OR contains(e.result, '_CF_')
                        OR e.result = 'TCP_REFRESH_UNMODIFIED', false)
                   AS cache_hit  -- sandbox.egress.EgressRecord.cache_hit
        FROM (SELECT run_id, episode_id, turn_index, unnest(egress) AS e
              FROM turns WHERE egress IS NOT NULL)
    """,
    ),
    View(
        "tool_calls",
        help="one row per tool call with its observation: command, exit code, time-out, duration",
        sql="""
        WITH c AS (
            SELECT run_id, episode_id, turn_index, observations,
                   unnest(tool_calls) AS call,
                   generate_subscripts(tool_calls, 1) - 1 AS call_index
            FROM turns
        ), j AS (
            SELECT *, list_filter(observations, lambda x: x.tool_call_id = call.id)[1] AS o FROM c
        )
        SELECT run_id, episode_id, turn_index, call_index,
               call.name AS tool, call.id AS tool_call_id, call.arguments AS arguments,
               -- execute_bash: the shell command; str_replace_editor: "<command> <path>"
               CASE WHEN json_valid(call.arguments)
                    THEN nullif(concat_ws(' ',
                             json_extract_string(call.arguments, '$.command'),
                             json_extract_string(call.arguments, '$.path')), '')
               END AS command,
               o.exit_code, o.timed_out, o.oom_killed, o.truncated, o.error,
               o.duration_s, length(o.content) AS output_chars
        FROM j
    """,
    ),
    # One verdict per episode (episode_score). Infra failures are counted apart, never as
    # wrong answers.
    View(
        "accuracy",
        help="accuracy by run x model x domain x mode (newest score per episode; infra failures apart)",
        sql="""
        SELECT e.run_id, e.model, e.domain, e.mode,
               count(*) AS episodes,
               count(*) FILTER (WHERE e.is_infra_failure) AS infra_failures,
               count(s.score) FILTER (WHERE NOT e.is_infra_failure) AS scored,
               round(avg(s.score) FILTER (WHERE NOT e.is_infra_failure), 4) AS accuracy,
               round(avg(e.num_turns), 2) AS avg_turns,
               round(avg(e.prompt_tokens + e.completion_tokens), 1) AS avg_tokens,
               string_agg(DISTINCT s.verifier, ',' ORDER BY s.verifier) AS verifiers
        FROM episodes e LEFT JOIN episode_score s USING (run_id, episode_id)
        GROUP BY e.run_id, e.model, e.domain, e.mode
        ORDER BY e.run_id, e.domain, e.mode
    """,
    ),
    View(
        "accuracy_by_verifier",
        help="the same per verifier (e.g. after re-scoring with another one)",
        sql="""
        SELECT e.run_id, e.model, e.domain, e.mode, s.verifier,
               count(*) AS episodes,
               count(*) FILTER (WHERE e.is_infra_failure) AS infra_failures,
               count(s.score) FILTER (WHERE NOT e.is_infra_failure) AS scored,
               round(avg(s.score) FILTER (WHERE NOT e.is_infra_failure), 4) AS accuracy
        FROM episodes e JOIN scores s USING (run_id, episode_id)
        GROUP BY ALL
        ORDER BY e.run_id, e.domain, e.mode, s.verifier
    """,
    ),
    View(
        "episode_tokens",
        help="tokens, turns and tool calls per episode",
        sql="""
        WITH t AS (
            SELECT run_id, episode_id,
                   count(*) AS turns,
                   sum(coalesce(prompt_tokens, 0)) AS prompt_tokens,
                   sum(coalesce(completion_tokens, 0)) AS completion_tokens,
                   sum(coalesce(cached_tokens, 0)) AS cached_tokens,
                   sum(coalesce(reasoning_tokens, 0)) AS reasoning_tokens,
                   sum(num_tool_calls) AS tool_calls,
                   max(prompt_tokens) AS peak_prompt_tokens
            FROM turns GROUP BY run_id, episode_id
        )
        SELECT e.run_id, e.episode_id, e.task_id, e.domain, e.mode, e.model, e.termination,
               coalesce(t.turns, 0) AS turns,
               coalesce(t.prompt_tokens, e.prompt_tokens) AS prompt_tokens,
               coalesce(t.completion_tokens, e.completion_tokens) AS completion_tokens,
               coalesce(t.cached_tokens, e.cached_tokens) AS cached_tokens,
               coalesce(t.reasoning_tokens, 0) AS reasoning_tokens,
               coalesce(t.prompt_tokens, e.prompt_tokens)
                 + coalesce(t.completion_tokens, e.completion_tokens) AS total_tokens,
               t.peak_prompt_tokens,
               coalesce(t.tool_calls, 0) AS tool_calls
        FROM episodes e LEFT JOIN t USING (run_id, episode_id)
    """,
    ),
    View(
        "capability_usage",
        help="share of turns using computation / file management / external resources",
        sql="""
        WITH tot AS (
            SELECT run_id, domain, mode, sum(num_turns) AS turns, count(*) AS episodes
            FROM episodes GROUP BY ALL
        ), u AS (
            SELECT DISTINCT u.run_id, e.domain, e.mode, u.episode_id, u.turn_index, u.capability
            FROM usage u JOIN episodes e USING (run_id, episode_id)
            WHERE u.capability <> 'none'
        )
        SELECT u.run_id, u.domain, u.mode, u.capability,
               count(*) AS turns_with_capability, any_value(tot.turns) AS turns,
               round(count(*) / nullif(any_value(tot.turns), 0), 4) AS rate
        FROM u JOIN tot USING (run_id, domain, mode)
        GROUP BY ALL
        ORDER BY u.run_id, u.domain, u.mode, u.capability
    """,
    ),
    View(
        "slow_tools",
        help="tool latency percentiles, time-outs, OOM kills by tool",
        sql="""
        SELECT tool, count(*) AS calls,
               round(quantile_cont(duration_s, 0.5), 3) AS p50_s,
               round(quantile_cont(duration_s, 0.95), 3) AS p95_s,
               round(max(duration_s), 3) AS max_s,
               count(*) FILTER (WHERE timed_out) AS timeouts,
               count(*) FILTER (WHERE oom_killed) AS oom_kills,
               count(*) FILTER (WHERE exit_code <> 0) AS nonzero_exits,
               count(*) FILTER (WHERE error IS NOT NULL) AS tool_errors
        FROM tool_calls GROUP BY tool ORDER BY p95_s DESC NULLS LAST
    """,
    ),
    View(
        "timeouts",
        help="commands that timed out, slowest first",
        sql="""
        SELECT c.run_id, e.domain, e.task_id, c.episode_id, c.turn_index, c.tool,
               c.command, round(c.duration_s, 2) AS duration_s, c.exit_code
        FROM tool_calls c JOIN episodes e USING (run_id, episode_id)
        WHERE c.timed_out
        ORDER BY c.duration_s DESC
    """,
    ),
    View(
        "errors",
        help="episodes by termination reason with an example error",
        sql="""
        SELECT run_id, coalesce(termination, 'unfinished') AS termination,
               any_value(is_infra_failure) AS infra, count(*) AS episodes,
               any_value(error) FILTER (WHERE error IS NOT NULL) AS example_error
        FROM episodes GROUP BY ALL ORDER BY run_id, episodes DESC
    """,
    ),
    # RL rollouts (rl/): one row per training run x step x policy version, over every
    # warehouse run that recorded them (the env's and the rollout server's).
    View(
        "rl_steps",
        help="RL rollouts by training run x step x policy: reward, turns, tokens, terminations",
        sql="""
        WITH t AS (
            SELECT run_id, episode_id, sum(num_tool_calls) AS tool_calls FROM turns GROUP BY ALL
        )
        SELECT e.training_run, e.training_step, e.policy_version,
               count(*) AS episodes,
               count(*) FILTER (WHERE e.is_infra_failure) AS infra_failures,
               round(avg(s.score) FILTER (WHERE NOT e.is_infra_failure), 4) AS mean_reward,
               round(avg(e.num_turns), 2) AS avg_turns,
               round(avg(e.prompt_tokens + e.completion_tokens), 1) AS avg_tokens,
               round(avg(e.completion_tokens), 1) AS avg_completion_tokens,
               round(sum(t.tool_calls) / nullif(sum(e.num_turns), 0), 3) AS tool_calls_per_turn,
               round(avg(CAST(e.termination = 'submitted' AS INTEGER)), 4) AS submitted_rate,
               round(avg(CAST(e.termination = 'max_steps' AS INTEGER)), 4) AS max_steps_rate,
               round(avg(CAST(e.termination = 'context_exhausted' AS INTEGER)), 4)
                   AS context_exhausted_rate,
               round(avg(CAST(e.token_ids_status = 'exact' AS INTEGER)), 4) AS exact_token_rate
        FROM episodes e LEFT JOIN episode_score s USING (run_id, episode_id)
             LEFT JOIN t USING (run_id, episode_id)
        WHERE e.training_run IS NOT NULL
        GROUP BY ALL ORDER BY e.training_run, e.training_step NULLS FIRST, e.policy_version
    """,
    ),
    View(
        "rl_capability_usage",
        help="RL rollouts: share of turns using each capability by training step",
        sql="""
        WITH tot AS (
            SELECT training_run, training_step, sum(num_turns) AS turns FROM episodes
            WHERE training_run IS NOT NULL GROUP BY ALL
        ), u AS (
            SELECT DISTINCT e.training_run, e.training_step, u.episode_id, u.turn_index,
                   u.capability
            FROM usage u JOIN episodes e USING (run_id, episode_id)
            WHERE e.training_run IS NOT NULL AND u.capability <> 'none'
        )
        SELECT u.training_run, u.training_step, u.capability,
               count(*) AS turns_with_capability, any_value(tot.turns) AS turns,
               round(count(*) / nullif(any_value(tot.turns), 0), 4) AS rate
        FROM u JOIN tot ON u.training_run = tot.training_run
             AND u.training_step IS NOT DISTINCT FROM tot.training_step
        GROUP BY ALL ORDER BY u.training_run, u.training_step NULLS FIRST, u.capability
    """,
    ),
    # Training (rl/train.py, docs/train.md): one row per optimizer step (its newest record:
    # a resumed run may record a step again), what the trainer logged, the step's time
    # split, and its rollouts (the episodes it lists: reward by their verifier, its spread
    # over the rollouts, the pass rate, the groups = tasks whose rollouts' rewards differ).
    View(
        "training_steps",
        help=(
            "one row per optimizer step of a training run (sandflow train): reward mean and "
            "spread, pass rate, groups with a reward spread, loss, KL, grad norm, tokens, the "
            "time split (generation, sandbox, reward, optimizer), env_share, its rollouts"
        ),
        sql="""
        WITH s AS (
            SELECT * FROM _raw_train_steps
            QUALIFY row_number() OVER (
                PARTITION BY training_run, step ORDER BY recorded_at DESC, batch_id DESC) = 1
        ), ro AS (
            SELECT l.training_run, l.step, e.task_id,
                   CASE WHEN NOT coalesce(e.is_infra_failure, false) THEN sc.score END AS score
            FROM (SELECT training_run, step, run_id, unnest(episode_ids) AS episode_id FROM s) l
            JOIN episodes e USING (run_id, episode_id)
            LEFT JOIN episode_score sc USING (run_id, episode_id)
        ), g AS (
            SELECT training_run, step, task_id, count(score) AS n,
                   coalesce(max(score) > min(score), false) AS spread
            FROM ro GROUP BY ALL
        ), a AS (
            SELECT training_run, step, count(*) AS rollouts_recorded,
                   count(score) AS rollouts_scored,
                   round(avg(score), 4) AS reward_mean,
                   round(stddev_pop(score), 4) AS reward_spread,
                   round(avg(CAST(score >= 1.0 AS INTEGER)), 4) AS pass_rate
            FROM ro GROUP BY ALL
        ), gs AS (
            SELECT training_run, step, count(*) AS groups,
                   count(*) FILTER (WHERE spread) AS groups_with_spread
            FROM g GROUP BY ALL
        )
        SELECT s.training_run, s.step, s.policy_version,
               a.reward_mean, a.reward_spread, a.pass_rate,
               gs.groups, gs.groups_with_spread,
               s.loss, s.kl, s.grad_norm, s.learning_rate, s.tokens,
               s.rollouts, a.rollouts_recorded, a.rollouts_scored, s.dropped,
               s.reward_mean AS trainer_reward_mean, s.reward_std AS trainer_reward_std,
               s.wall_s, s.generation_s, s.sandbox_s, s.reward_s, s.optimizer_s, s.env_share,
               s.run_id, s.episode_ids, s.recorded_at
        FROM s LEFT JOIN a USING (training_run, step) LEFT JOIN gs USING (training_run, step)
        ORDER BY s.training_run, s.step
    """,
    ),
)

# Branched episodes (issue #25): an episode forked from a live sandbox or replayed from a
# recorded one names its parent (parent_run_id / parent_episode_id; a NULL parent_run_id
# means the same run), the first turn it produced itself (branch_turn) and how
# (branch_kind). An episode whose parent is not in the warehouse is a root of its own
# tree (its parent columns still name it); parent links that form a cycle (never written
# by sandflow) reach no root and are left out. Depth is bounded at 64 generations.
EPISODE_TREE = View(
    "episode_tree",
    help=(
        "one row per episode with its lineage: root, parent, depth, branch_turn, branch_kind "
        "(fork | replay; NULL: started from its task), children"
    ),
    sql="""
    WITH RECURSIVE tree(run_id, episode_id, root_run_id, root_episode_id, depth) AS (
        SELECT e.run_id, e.episode_id, e.run_id, e.episode_id, 0
        FROM episodes e
        WHERE e.parent_episode_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM episodes p
            WHERE p.run_id = coalesce(e.parent_run_id, e.run_id)
              AND p.episode_id = e.parent_episode_id)
        UNION ALL
        SELECT c.run_id, c.episode_id, t.root_run_id, t.root_episode_id, t.depth + 1
        FROM tree t JOIN episodes c
          ON c.parent_episode_id = t.episode_id AND coalesce(c.parent_run_id, c.run_id) = t.run_id
        WHERE t.depth < 64
    ), kids AS (
        SELECT coalesce(parent_run_id, run_id) AS run_id, parent_episode_id AS episode_id,
               count(*) AS children
        FROM episodes WHERE parent_episode_id IS NOT NULL GROUP BY ALL
    )
    SELECT t.root_run_id, t.root_episode_id, e.run_id, e.episode_id,
           CASE WHEN e.parent_episode_id IS NOT NULL
                THEN coalesce(e.parent_run_id, e.run_id) END AS parent_run_id,
           e.parent_episode_id, t.depth, e.branch_turn, e.branch_kind,
           coalesce(k.children, 0) AS children,
           e.task_id, e.model, e.termination, e.num_turns, e.answer
    FROM tree t JOIN episodes e USING (run_id, episode_id)
         LEFT JOIN kids k USING (run_id, episode_id)
""",
)
LINEAGE: tuple[View, ...] = (EPISODE_TREE,)

# Nightly lineage and statistics (warehouse/series.py): created after the ones above,
# which they read.
SERIES: tuple[View, ...] = tuple(
    View(name, sql=sql, help=SERIES_VIEW_HELP.get(name, "")) for name, sql in SERIES_VIEWS.items()
)

# RL data builds (warehouse/data_views.py): funnel, drops, provenance.
DATA: tuple[View, ...] = tuple(
    View(name, sql=sql, help=DATA_VIEW_HELP.get(name, "")) for name, sql in DATA_VIEWS.items()
)

# What runs cost (warehouse/cost.py): turns and episodes priced by the `_run_prices`
# table the session builds from each run's recorded price table.
COST: tuple[View, ...] = tuple(
    View(name, sql=sql, help=COST_VIEW_HELP.get(name, "")) for name, sql in COST_VIEWS.items()
)

VIEWS: tuple[View, ...] = (*BASE_VIEWS, *LINEAGE, *SERIES, *DATA, *COST)

# name -> help of every listed view, in creation order (what `sandflow sql` shows)
VIEW_HELP: dict[str, str] = {v.name: v.help for v in VIEWS if v.help}
