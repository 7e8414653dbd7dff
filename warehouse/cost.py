"""What a run cost: its tokens in dollars, as SQL views.

Prices come from the price table each run recorded when it started (``runs.config`` ->
``prices``, a tasks.pricing.PriceTable), so the cost is a property of what the warehouse
holds, not of the process that asks. A table handed to the query session
(``WarehouseQuery(prices=...)``: ``sandflow sql --prices``) prices what it names first, e.g.
a run recorded before its model had a price.

Resolved here, in Python, into one small table ``_run_prices`` (run x model -> four rates),
which the views join; a run x model with no price has no row there and every cost of it
is NULL ("unknown"), never 0. A turn whose server reported no usage is unknown too.

Views (registered by warehouse/query.py after the base views):

  turn_cost     one row per turn: model, the four token counts, cost_usd; `inherited`: a
                branch's turn before its branch_turn (its parent's, paid there: cost 0)
  episode_cost  one row per episode: tokens, turns, unpriced_turns, cost_usd
                (NULL when any turn is unpriced; 0 for a priced episode with no turns),
                sandbox_cpu_s and sandbox_peak_memory_bytes (from the sandbox's cgroup)
  run_cost      one row per run: episodes, tokens, unpriced_turns, cost_usd (NULL when
                any turn is unpriced), known_cost_usd (the priced turns only),
                cost_per_episode, models; the sandbox side: sandbox_cpu_s (summed),
                sandbox_peak_memory_bytes (the largest episode's), sandbox_episodes_measured; replaced_cost_usd (what attempts since replaced by a re-run paid:
                episodes.replaced) and paid_cost_usd (all the run paid)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import pyarrow as pa

from tasks.pricing import Price, PriceTable, load_prices
from tasks.records import MAX_TOKEN_COUNT, Spend
from warehouse.schema import check_run_id

log = logging.getLogger(__name__)

RUN_PRICES_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field("model", pa.string()),
        # one column per rate of tasks.pricing.Price (input, cached_input, output,
        # reasoning: the order of Price.rates), USD per million tokens
        *(pa.field(f"{rate}_per_m", pa.float64()) for rate in Price.model_fields),
        pa.field("price_source", pa.string()),  # run (recorded) | session (handed in)
    ]
)


def recorded_prices(config_json: str | None) -> tuple[PriceTable, str | None]:
    """(the price table a run recorded, its endpoint) from ``runs.config``; an unreadable
    table is logged and treated as none (its costs are unknown, never 0)."""
    try:
        cfg = json.loads(config_json or "{}")
    except json.JSONDecodeError:
        return PriceTable({}), None
    if not isinstance(cfg, dict):
        return PriceTable({}), None
    model = cfg.get("model")
    base_url = model.get("base_url") if isinstance(model, dict) else None
    raw = cfg.get("prices")
    if not raw:
        return PriceTable({}), base_url if isinstance(base_url, str) else None
    try:
        table = load_prices(raw if isinstance(raw, dict) else None)
    except ValueError as exc:
        log.warning("a run's recorded price table is unreadable (its cost is unknown): %s", exc)
        table = PriceTable({})
    return table, base_url if isinstance(base_url, str) else None


def run_prices(
    runs: Iterable[tuple[str, str | None]],
    models: Iterable[tuple[str, str | None]],
    session: PriceTable | None = None,
) -> pa.Table:
    """``_run_prices``: one row per (run, model) that has a price.

    `runs`: (run_id, config JSON) of each run; `models`: distinct (run_id, model) of its
    episodes; `session`: a table that wins over the run's own where it names the model.
    """
    recorded = {rid: recorded_prices(cfg) for rid, cfg in runs}
    rows: dict[str, list[Any]] = {f.name: [] for f in RUN_PRICES_SCHEMA}
    for rid, model in models:
        own, base_url = recorded.get(rid, (PriceTable({}), None))
        price, source = None, None
        if session:
            price, source = session.lookup(model, base_url), "session"
        if price is None:
            price, source = own.lookup(model, base_url), "run"
        if price is None:
            continue
        inp, cached, out, reasoning = price.rates()
        for name, value in zip(
            RUN_PRICES_SCHEMA.names,
            (rid, model, inp, cached, out, reasoning, source),
            strict=True,
        ):
            rows[name].append(value)
    return pa.Table.from_pydict(rows, schema=RUN_PRICES_SCHEMA)


# Cached tokens are part of the prompt and reasoning tokens part of the completion
# (the OpenAI usage object): each is priced at its own rate and taken out of the other.
_TURN_COST = """
    ((t.prompt_tokens - least(coalesce(t.cached_tokens, 0), t.prompt_tokens)) * p.input_per_m
     + least(coalesce(t.cached_tokens, 0), t.prompt_tokens) * p.cached_input_per_m
     + (t.completion_tokens - least(coalesce(t.reasoning_tokens, 0), t.completion_tokens))
       * p.output_per_m
     + least(coalesce(t.reasoning_tokens, 0), t.completion_tokens) * p.reasoning_per_m
    ) / 1e6
"""

# A stored count outside [0, MAX_TOKEN_COUNT] (a file written before counts were bounded:
# a negative prompt_tokens once priced a run at -$99.99) is unknown: its turn is unpriced.
_BOUNDED_TURN = ", ".join(
    f"CASE WHEN t.{c} BETWEEN 0 AND {MAX_TOKEN_COUNT} THEN t.{c} END AS {c}"
    for c in ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens")
)

# The cost of an episode's replaced attempts from their sums (cached at most prompt,
# reasoning at most completion, as tasks.records.Spend sums them turn by turn).
_REPLACED_COST = (
    "("
    + " + ".join(
        f"greatest(coalesce(TRY_CAST(e.replaced->>'{key}' AS BIGINT), 0), 0) * {rate}"
        for key, rate in (
            ("prompt_tokens", "p.input_per_m"),
            ("cached_tokens", "(p.cached_input_per_m - p.input_per_m)"),
            ("completion_tokens", "p.output_per_m"),
            ("reasoning_tokens", "(p.reasoning_per_m - p.output_per_m)"),
        )
    )
    + ") / 1e6"
)

COST_VIEWS: dict[str, str] = {
    # A branched episode's turns before its branch_turn are its parent's (forked or
    # replayed, issue #25): paid once, by the parent; here `inherited` and cost 0.
    "turn_cost": f"""
        SELECT t.run_id, t.episode_id, t.turn_index, e.model,
               t.prompt_tokens, t.completion_tokens,
               coalesce(t.cached_tokens, 0) AS cached_tokens,
               coalesce(t.reasoning_tokens, 0) AS reasoning_tokens,
               p.price_source,
               CASE WHEN t.turn_index < e.branch_turn THEN 0.0 ELSE {_TURN_COST} END AS cost_usd,
               coalesce(t.turn_index < e.branch_turn, false) AS inherited
        FROM (SELECT * REPLACE ({_BOUNDED_TURN}) FROM turns t) t
        JOIN episodes e USING (run_id, episode_id)
        LEFT JOIN _run_prices p ON p.run_id = t.run_id AND p.model = e.model
    """,
    # Tokens as `episode_tokens` counts them (one definition); cost from the turns. An
    # episode with tokens but no turn rows (its turns file is lost) is unknown, not free.
    "episode_cost": """
        WITH t AS (
            SELECT run_id, episode_id,
                   count(*) FILTER (WHERE cost_usd IS NULL) AS unpriced_turns,
                   sum(cost_usd) AS known_cost_usd
            FROM turn_cost GROUP BY run_id, episode_id
        )
        SELECT k.run_id, k.episode_id, k.task_id, k.domain, k.mode, e.sample_index, k.model,
               k.termination, k.turns, k.prompt_tokens, k.completion_tokens, k.cached_tokens,
               k.reasoning_tokens,
               CASE WHEN p.run_id IS NULL THEN k.turns
                    ELSE coalesce(t.unpriced_turns, 0) END AS unpriced_turns,
               CASE WHEN p.run_id IS NULL OR coalesce(t.unpriced_turns, 0) > 0 THEN NULL
                    WHEN t.run_id IS NULL AND coalesce(k.total_tokens, 0) > 0 THEN NULL
                    ELSE coalesce(t.known_cost_usd, 0.0) END AS cost_usd,
               e.sandbox_cpu_s, e.sandbox_peak_memory_bytes,
               -- what the attempts this one replaced paid (episodes.replaced): 0 for a
               -- first attempt, NULL when unpriced or when one of their turns was
               CASE WHEN e.replaced IS NULL THEN 0.0
                    WHEN p.run_id IS NULL
                         OR coalesce(TRY_CAST(e.replaced->>'unreported_turns' AS BIGINT), 1) > 0
                    THEN NULL
                    ELSE {replaced_cost} END AS replaced_cost_usd
        FROM episode_tokens k JOIN episodes e USING (run_id, episode_id)
        LEFT JOIN t USING (run_id, episode_id)
        LEFT JOIN _run_prices p ON p.run_id = k.run_id AND p.model = k.model
    """.replace("{replaced_cost}", _REPLACED_COST),
    "run_cost": """
        SELECT r.run_id,
               string_agg(DISTINCT c.model, ',' ORDER BY c.model) AS models,
               count(c.episode_id) AS episodes,
               coalesce(sum(c.turns), 0) AS turns,
               coalesce(sum(c.prompt_tokens), 0) AS prompt_tokens,
               coalesce(sum(c.completion_tokens), 0) AS completion_tokens,
               coalesce(sum(c.cached_tokens), 0) AS cached_tokens,
               coalesce(sum(c.reasoning_tokens), 0) AS reasoning_tokens,
               coalesce(sum(c.unpriced_turns), 0) AS unpriced_turns,
               count(*) FILTER (WHERE c.episode_id IS NOT NULL AND c.cost_usd IS NULL)
                   AS unpriced_episodes,
               CASE WHEN count(*) FILTER (WHERE c.episode_id IS NOT NULL AND c.cost_usd IS NULL) > 0
                    THEN NULL ELSE coalesce(sum(c.cost_usd), 0.0) END AS cost_usd,
               sum(c.cost_usd) AS known_cost_usd,
               CASE WHEN count(*) FILTER (WHERE c.episode_id IS NOT NULL AND c.cost_usd IS NULL) > 0
                    THEN NULL ELSE sum(c.cost_usd) / nullif(count(c.episode_id), 0)
               END AS cost_per_episode,
               -- the sandbox side: summed over the episodes whose backend measured it
               count(c.sandbox_cpu_s) AS sandbox_episodes_measured,
               sum(c.sandbox_cpu_s) AS sandbox_cpu_s,
               max(c.sandbox_peak_memory_bytes) AS sandbox_peak_memory_bytes,
               -- money spent on attempts since replaced by a re-run (episodes.replaced),
               -- and all the run paid: cost_usd prices the current attempts only
               CASE WHEN count(*) FILTER (WHERE c.episode_id IS NOT NULL AND c.replaced_cost_usd IS NULL) > 0
                    THEN NULL ELSE coalesce(sum(c.replaced_cost_usd), 0.0) END AS replaced_cost_usd,
               CASE WHEN count(*) FILTER (WHERE c.episode_id IS NOT NULL
                                          AND (c.cost_usd IS NULL OR c.replaced_cost_usd IS NULL)) > 0
                    THEN NULL ELSE coalesce(sum(c.cost_usd + c.replaced_cost_usd), 0.0) END AS paid_cost_usd
        FROM (SELECT run_id FROM runs UNION SELECT run_id FROM episodes) r
        LEFT JOIN episode_cost c USING (run_id)
        GROUP BY r.run_id ORDER BY r.run_id
    """,
}

COST_VIEW_HELP: dict[str, str] = {
    "turn_cost": "one row per turn: model, tokens and cost_usd (NULL: the model has no price)",
    "episode_cost": "one row per episode: tokens, unpriced_turns, cost_usd (NULL: unknown), "
    "sandbox CPU-seconds and peak memory (from its cgroup)",
    "run_cost": "one row per run: tokens, cost_usd (NULL if any turn is unpriced), "
    "known_cost_usd, cost_per_episode, sandbox CPU-seconds (sum) and peak memory (max)",
}


# The report's table: a run's cost per mode and overall (`mode` = '(all)', as analysis.metrics.ALL).
_COST_BY_MODE = """
    SELECT coalesce(mode, '(all)') AS mode, count(*) AS episodes, sum(turns) AS turns,
           sum(prompt_tokens) AS prompt_tokens, sum(cached_tokens) AS cached_tokens,
           sum(completion_tokens) AS completion_tokens, sum(reasoning_tokens) AS reasoning_tokens,
           sum(unpriced_turns) AS unpriced_turns,
           CASE WHEN count(cost_usd) < count(*) THEN NULL ELSE sum(cost_usd) END AS cost_usd,
           CASE WHEN count(cost_usd) < count(*) THEN NULL ELSE sum(cost_usd) / count(*) END
               AS cost_per_episode,
           round(sum(sandbox_cpu_s), 2) AS sandbox_cpu_s,
           round(max(sandbox_peak_memory_bytes) / 1048576, 1) AS sandbox_peak_mib
    FROM episode_cost WHERE run_id = '{run_id}'
    GROUP BY ROLLUP (mode) ORDER BY mode NULLS LAST
"""


def cost_by_mode(q: Any, run_id: str) -> list[dict[str, Any]]:
    """One row per mode and one for the whole run (`mode` '(all)'); cost_usd None: unknown.
    `q` is a warehouse.query.WarehouseQuery."""
    rel = q.execute(_COST_BY_MODE.format(run_id=check_run_id(run_id)))  # a safe alphabet
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, row, strict=True)) for row in rel.fetchall()]


# A branched episode's turns before its branch_turn are its parent's (a tree's siblings
# each record the shared prefix): paid once, by the parent, as in `turn_cost`. A count
# outside [0, MAX_TOKEN_COUNT] (a file written before counts were bounded) is unknown.
_BOUNDED = "CASE WHEN t.{c} BETWEEN 0 AND " + str(MAX_TOKEN_COUNT) + " THEN t.{c} END"
_PAID = """
WITH t AS (
    SELECT t.episode_id, {p} AS p, {c} AS c, {k} AS k, {r} AS r
    FROM turns t LEFT JOIN episodes e USING (run_id, episode_id)
    WHERE t.run_id = '{run_id}' AND NOT coalesce(t.turn_index < e.branch_turn, false)
), own AS (
    SELECT episode_id, count(*) AS turns,
           count(*) FILTER (WHERE p IS NULL OR c IS NULL) AS unreported,
           coalesce(sum(p) FILTER (WHERE p IS NOT NULL AND c IS NOT NULL), 0) AS p,
           coalesce(sum(c) FILTER (WHERE p IS NOT NULL AND c IS NOT NULL), 0) AS c,
           coalesce(sum(least(coalesce(k, 0), p)) FILTER (WHERE p IS NOT NULL AND c IS NOT NULL), 0) AS k,
           coalesce(sum(least(coalesce(r, 0), c)) FILTER (WHERE p IS NOT NULL AND c IS NOT NULL), 0) AS r
    FROM t GROUP BY episode_id
), rep AS (
    SELECT episode_id, replaced FROM episodes
    WHERE run_id = '{run_id}' AND replaced IS NOT NULL
)
SELECT episode_id, coalesce(own.turns, 0), coalesce(own.unreported, 0), coalesce(own.p, 0),
       coalesce(own.c, 0), coalesce(own.k, 0), coalesce(own.r, 0), rep.replaced
FROM own FULL OUTER JOIN rep USING (episode_id)
""".format(
    p=_BOUNDED.format(c="prompt_tokens"),
    c=_BOUNDED.format(c="completion_tokens"),
    k=_BOUNDED.format(c="cached_tokens"),
    r=_BOUNDED.format(c="reasoning_tokens"),
    run_id="{run_id}",
)


class RunSpend(NamedTuple):
    """What a run's recorded attempts used (warehouse.cost.run_spend)."""

    tokens: int  # prompt + completion of every turn whose server reported usage
    prompt: int  # the next four: over those turns too
    completion: int
    cached: int  # at most prompt, turn by turn
    reasoning: int  # at most completion, turn by turn
    unreported: int  # turns whose server reported no usage (or an impossible count)


def _replaced(text: Any) -> Spend:
    """An episode row's `replaced` (the warehouse's own JSON, still read defensively: a
    value that is not a Spend of counts is nothing carried)."""
    try:
        spend = Spend.model_validate_json(text) if isinstance(text, str) else Spend()
    except ValueError:
        return Spend()
    values = spend.model_dump().values()
    return spend if all(0 <= v <= MAX_TOKEN_COUNT * 1000 for v in values) else Spend()


def paid_by_episode(q: Any, run_id: str) -> dict[str, Spend]:
    """What each episode of a run has paid for: its current attempt's turns plus what the
    attempts it replaced paid (`episodes.replaced`, carried on by each re-run), so money
    spent stays counted whatever is replaced. In SQL (one aggregate; the turns' text is
    never read). A branch's inherited turns (before its branch_turn) are its parent's."""
    out: dict[str, Spend] = {}
    for eid, turns, unreported, p, c, k, r, replaced in q.execute(
        _PAID.format(run_id=check_run_id(run_id))
    ).fetchall():
        prior = _replaced(replaced)
        own = Spend(
            attempts=1 if turns else 0, turns=int(turns), unreported_turns=int(unreported),
            prompt_tokens=int(p), completion_tokens=int(c), cached_tokens=int(k),
            reasoning_tokens=int(r),
        )  # fmt: skip
        out[str(eid)] = add_spend(prior, own)
    return out


def add_spend(a: Spend, b: Spend) -> Spend:
    return Spend(**{f: getattr(a, f) + getattr(b, f) for f in Spend.model_fields})


def run_spend(q: Any, run_id: str) -> RunSpend:
    """A run's recorded spend summed (`paid_by_episode`): what a budget counts
    (engine/budget.py). tasks.pricing.Price.cost of the sums is the sum of the turns' costs
    (its clamps are per turn here)."""
    total = Spend()
    for spend in paid_by_episode(q, run_id).values():
        total = add_spend(total, spend)
    return RunSpend(
        total.prompt_tokens + total.completion_tokens, total.prompt_tokens,
        total.completion_tokens, total.cached_tokens, total.reasoning_tokens,
        total.unreported_turns,
    )  # fmt: skip


def token_sums(q: Any, run_id: str) -> tuple[int, int, int, int, int]:
    """(tokens of every turn, then over the turns whose server reported usage: prompt,
    completion, cached, reasoning): `run_spend` without the count of unreported turns."""
    return tuple(run_spend(q, run_id)[:5])  # type: ignore[return-value]
