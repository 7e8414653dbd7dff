"""What each page shows, as parameterised SQL over the warehouse's views.

Every list is one page of rows (LIMIT/OFFSET over episodes, keyset on turn_index for
turns), so a page costs the same on a warehouse of a thousand turns or a million: no
query here ever fetches all turns. Values typed into the filters are bound as
parameters, never pasted into the SQL; sort keys come from a fixed list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from sandflow.viewer.store import LiveWarehouse
from warehouse.fields import TURN_COLUMNS as stored_turn_columns

EPISODES_PER_PAGE = 50
TURNS_PER_PAGE = 25
CAPABILITY_FILTERS = ("computation", "file_management", "external_resource", "none")
SCORE_FILTERS = {
    "correct": "s.score >= 1",
    "incorrect": "s.score <= 0",
    "partial": "s.score > 0 AND s.score < 1",
    "scored": "s.score IS NOT NULL",
    "unscored": "s.score IS NULL",
}
SORTS = {
    "task": "e.task_id, e.mode, e.sample_index",
    "score": "s.score",
    "turns": "e.num_turns",
    "tokens": "(coalesce(e.prompt_tokens, 0) + coalesce(e.completion_tokens, 0))",
    "wall": "e.wall_s",
    "termination": "e.termination",
    "started": "e.started_at",
}

# One verdict per episode: the warehouse's `episode_score` view (warehouse/views.py), the
# one the `accuracy` view reads.
NEWEST_SCORE = """
    SELECT run_id, episode_id, verifier, score, passed, reason FROM episode_score
    WHERE run_id IN ({runs})
"""


def _placeholders(n: int) -> str:
    return ", ".join("?" for _ in range(n))


def _total(page: list[dict[str, Any]]) -> int:
    """The rows on all pages of a paged query: every paged query counts them in a column
    `total` (`count(*) OVER ()`, taken before LIMIT/OFFSET); an empty page: 0."""
    return int(page[0]["total"]) if page else 0


def _attach(
    rows: list[dict[str, Any]],
    key: str,
    field: str,
    fetch: Callable[[list[Any]], list[dict[str, Any]]],
) -> None:
    """Give each row of a page the rows `fetch` returns for its `key`, as the list `field`:
    one query for the whole page (`fetch` gets the page's keys), not one per row; none for
    an empty page."""
    if not rows:
        return
    by_key: dict[Any, list[dict[str, Any]]] = {}
    for x in fetch([r[key] for r in rows]):
        by_key.setdefault(x[key], []).append(x)
    for r in rows:
        r[field] = by_key.get(r[key], [])


@dataclass
class EpisodeFilter:
    """The run page's filters (all optional); `from_query` ignores unknown values."""

    domain: str | None = None
    mode: str | None = None
    termination: str | None = None
    score: str | None = None  # a key of SCORE_FILTERS
    min_score: float | None = None
    max_score: float | None = None
    usage: str | None = None  # a capability; "none": episodes that used none
    task: str | None = None  # substring of the task id
    sort: str = "task"
    desc: bool = False

    @classmethod
    def from_query(cls, q: dict[str, str]) -> EpisodeFilter:
        def text(k: str) -> str | None:
            v = (q.get(k) or "").strip()
            return v[:200] or None

        def num(k: str) -> float | None:
            try:
                return float(q[k]) if q.get(k, "").strip() else None
            except ValueError:
                return None

        score = text("score")
        usage = text("usage")
        sort = text("sort") or "task"
        return cls(
            domain=text("domain"),
            mode=text("mode"),
            termination=text("termination"),
            score=score if score in SCORE_FILTERS else None,
            min_score=num("min_score"),
            max_score=num("max_score"),
            usage=usage if usage in CAPABILITY_FILTERS else None,
            task=text("task"),
            sort=sort if sort in SORTS else "task",
            desc=q.get("desc") in ("1", "true", "on"),
        )

    def as_query(self) -> dict[str, str]:
        """The non-empty filters as URL query parameters."""
        out: dict[str, str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or v is False or (f.name == "sort" and v == "task"):
                continue
            out[f.name] = "1" if v is True else (f"{v:g}" if isinstance(v, float) else str(v))
        return out

    def where(self) -> tuple[list[str], list[Any]]:
        conds: list[str] = []
        params: list[Any] = []
        for col in ("domain", "mode"):
            v = getattr(self, col)
            if v is not None:
                conds.append(f"e.{col} = ?")
                params.append(v)
        if self.termination == "unfinished":
            conds.append("e.termination IS NULL")
        elif self.termination is not None:
            conds.append("e.termination = ?")
            params.append(self.termination)
        if self.score is not None:
            conds.append(SCORE_FILTERS[self.score])
        if self.min_score is not None:
            conds.append("s.score >= ?")
            params.append(self.min_score)
        if self.max_score is not None:
            conds.append("s.score <= ?")
            params.append(self.max_score)
        if self.usage == "none":
            conds.append(
                "NOT EXISTS (SELECT 1 FROM usage u WHERE u.run_id = e.run_id "
                "AND u.episode_id = e.episode_id AND u.capability <> 'none')"
            )
        elif self.usage is not None:
            conds.append(
                "EXISTS (SELECT 1 FROM usage u WHERE u.run_id = e.run_id "
                "AND u.episode_id = e.episode_id AND u.capability = ?)"
            )
            params.append(self.usage)
        if self.task is not None:
            conds.append("contains(e.task_id, ?)")
            params.append(self.task)
        return conds, params


# ---- runs ---------------------------------------------------------------------------
def runs(
    lw: LiveWarehouse, *, limit: int = 200, offset: int = 0
) -> tuple[list[dict[str, Any]], int]:
    """Every run (newest first), with its episode counts, accuracy by mode and live episodes."""
    res = lw.fetch(
        """
        WITH e AS (
            SELECT run_id, count(*) AS episodes,
                   count(*) FILTER (WHERE is_infra_failure) AS infra_failures,
                   sum(num_turns) AS turns, min(started_at) AS first_started,
                   max(ended_at) AS last_ended, any_value(model) AS model
            FROM episodes GROUP BY run_id
        ), live AS (
            SELECT run_id, count(DISTINCT episode_id) AS live_episodes
            FROM partial_turns WHERE journal_state = 'live' GROUP BY run_id
        )
        SELECT coalesce(r.run_id, e.run_id, live.run_id) AS run_id, r.status,
               coalesce(r.model, e.model) AS model, r.dataset,
               coalesce(r.started_at, e.first_started) AS started_at,
               coalesce(r.ended_at, e.last_ended) AS ended_at,
               coalesce(e.episodes, 0) AS episodes, coalesce(e.infra_failures, 0) AS infra_failures,
               coalesce(e.turns, 0) AS turns, coalesce(live.live_episodes, 0) AS live_episodes,
               count(*) OVER () AS total
        FROM runs r FULL OUTER JOIN e USING (run_id) FULL OUTER JOIN live USING (run_id)
        ORDER BY started_at DESC NULLS LAST, run_id
        LIMIT ? OFFSET ?
        """,
        [limit, offset],
    )
    rows = res.rows

    def accuracy(ids: list[Any]) -> list[dict[str, Any]]:
        return lw.fetch(
            f"""
            WITH s AS ({NEWEST_SCORE.format(runs=_placeholders(len(ids)))})
            SELECT e.run_id, e.mode,
                   round(100 * avg(s.score) FILTER (WHERE NOT e.is_infra_failure), 1) AS accuracy,
                   count(s.score) AS scored
            FROM episodes e LEFT JOIN s USING (run_id, episode_id)
            WHERE e.run_id IN ({_placeholders(len(ids))})
            GROUP BY ALL ORDER BY e.mode
            """,
            [*ids, *ids],
        ).rows

    _attach(rows, "run_id", "accuracy", accuracy)
    costs = {c["run_id"]: c for c in run_costs(lw, [r["run_id"] for r in rows])}
    for r in rows:
        r["cost"] = costs.get(r["run_id"])
    return rows, _total(rows)


def run_costs(lw: LiveWarehouse, run_ids: list[str]) -> list[dict[str, Any]]:
    """`run_cost` rows of these runs (warehouse/cost.py: priced with the price table each
    run recorded; cost_usd NULL = unknown, never 0). The filter on run_id reaches the
    partitioned turns, so a page of runs reads only their turns."""
    if not run_ids:
        return []
    return lw.fetch(
        "SELECT run_id, models, turns, prompt_tokens, completion_tokens, cached_tokens, "
        "reasoning_tokens, unpriced_turns, unpriced_episodes, cost_usd, known_cost_usd, "
        "cost_per_episode, sandbox_cpu_s, sandbox_peak_memory_bytes "
        f"FROM run_cost WHERE run_id IN ({_placeholders(len(run_ids))})",
        run_ids,
    ).rows


def run_info(lw: LiveWarehouse, run_id: str) -> dict[str, Any] | None:
    row = lw.one("SELECT * FROM runs WHERE run_id = ?", [run_id])
    counts = lw.one(
        "SELECT count(*) AS episodes, count(*) FILTER (WHERE is_infra_failure) AS infra_failures, "
        "min(started_at) AS first_started, max(ended_at) AS last_ended, any_value(model) AS model "
        "FROM episodes WHERE run_id = ?",
        [run_id],
    )
    live = lw.one(
        "SELECT count(DISTINCT episode_id) AS n FROM partial_turns WHERE run_id = ? "
        "AND journal_state = 'live'",
        [run_id],
    )
    n_eps = int(counts["episodes"]) if counts else 0
    n_live = int(live["n"]) if live else 0
    if row is None and n_eps == 0 and n_live == 0:
        return None
    info: dict[str, Any] = {  # a run recorded without a runs row still has a page
        "run_id": run_id, "status": None, "model": None, "dataset": None,
        "started_at": None, "ended_at": None, "config": None,
    }  # fmt: skip
    info.update(row or {})
    info.update(
        episodes=n_eps,
        infra_failures=counts["infra_failures"] if counts else 0,
        live_episodes=n_live,
    )
    info.setdefault("model", None)
    if not info.get("model") and counts:
        info["model"] = counts["model"]
    if not info.get("started_at") and counts:
        info["started_at"] = counts["first_started"]
    # live: the run says it is running, or episodes are being recorded right now
    info["live"] = info.get("status") == "running" or n_live > 0
    return info


def run_accuracy(lw: LiveWarehouse, run_id: str) -> list[dict[str, Any]]:
    return lw.fetch(
        "SELECT domain, mode, episodes, infra_failures, scored, accuracy, avg_turns, avg_tokens, "
        "verifiers FROM accuracy WHERE run_id = ? ORDER BY domain, mode",
        [run_id],
    ).rows


def filter_options(lw: LiveWarehouse, run_id: str) -> dict[str, list[str]]:
    res = lw.fetch(
        "SELECT list(DISTINCT domain ORDER BY domain) AS domains, "
        "list(DISTINCT mode ORDER BY mode) AS modes, "
        "list(DISTINCT coalesce(termination, 'unfinished') ORDER BY 1) AS terminations "
        "FROM episodes WHERE run_id = ?",
        [run_id],
    ).rows
    r = res[0] if res else {}
    return {
        "domain": [x for x in (r.get("domains") or []) if x is not None],
        "mode": [x for x in (r.get("modes") or []) if x is not None],
        "termination": [x for x in (r.get("terminations") or []) if x is not None],
    }


# ---- episodes -----------------------------------------------------------------------
def episodes(
    lw: LiveWarehouse, run_id: str, flt: EpisodeFilter, page: int
) -> tuple[list[dict[str, Any]], int]:
    """One page of a run's episodes matching `flt`, with verdicts; and the total count."""
    conds, params = flt.where()
    where = " AND ".join(["e.run_id = ?", *conds])
    order = SORTS[flt.sort] + (" DESC" if flt.desc else "") + " NULLS LAST"
    res = lw.fetch(
        f"""
        WITH s AS ({NEWEST_SCORE.format(runs="?")})
        SELECT e.episode_id, e.task_id, e.domain, e.mode, e.sample_index, e.termination,
               e.is_infra_failure, e.num_turns,
               coalesce(e.prompt_tokens, 0) + coalesce(e.completion_tokens, 0) AS tokens,
               e.wall_s, left(e.answer, 160) AS answer, length(e.answer) AS answer_chars,
               s.score, s.passed, s.verifier, left(s.reason, 160) AS reason,
               count(*) OVER () AS total
        FROM episodes e LEFT JOIN s USING (run_id, episode_id)
        WHERE {where}
        ORDER BY {order}, e.task_id, e.mode, e.sample_index, e.episode_id
        LIMIT ? OFFSET ?
        """,
        [run_id, run_id, *params, EPISODES_PER_PAGE, max(0, page) * EPISODES_PER_PAGE],
    )
    rows = res.rows

    def usage(ids: list[Any]) -> list[dict[str, Any]]:
        return lw.fetch(
            f"""
            SELECT episode_id, capability, count(DISTINCT turn_index) AS turns FROM usage
            WHERE run_id = ? AND episode_id IN ({_placeholders(len(ids))}) AND capability <> 'none'
            GROUP BY ALL ORDER BY capability
            """,
            [run_id, *ids],
        ).rows

    _attach(rows, "episode_id", "usage", usage)
    if not rows and page > 0:  # past the last page: the total is still the filter's
        return rows, episodes(lw, run_id, flt, 0)[1]
    return rows, _total(rows)


def live_episodes(lw: LiveWarehouse, run_id: str) -> list[dict[str, Any]]:
    """Episodes whose turns are still only in journals (being recorded, or orphaned)."""
    return lw.fetch(
        """
        SELECT episode_id, any_value(task_id) AS task_id, any_value(domain) AS domain,
               any_value(mode) AS mode, any_value(journal_state) AS state,
               count(*) AS turns, max(turn_index) AS last_turn, max(started_at) AS last_turn_at,
               sum(coalesce(prompt_tokens, 0) + coalesce(completion_tokens, 0)) AS tokens
        FROM partial_turns WHERE run_id = ?
        GROUP BY episode_id
        ORDER BY state = 'live' DESC, last_turn_at DESC
        LIMIT 200
        """,
        [run_id],
    ).rows


def episode(lw: LiveWarehouse, run_id: str, episode_id: str) -> dict[str, Any] | None:
    return lw.one(
        "SELECT * FROM episodes WHERE run_id = ? AND episode_id = ?", [run_id, episode_id]
    )


def partial_episode(lw: LiveWarehouse, run_id: str, episode_id: str) -> dict[str, Any] | None:
    """An episode known only from its journal: what its turns say about it."""
    return lw.one(
        """
        SELECT run_id, episode_id, any_value(task_id) AS task_id, any_value(domain) AS domain,
               any_value(mode) AS mode, any_value(journal_state) AS journal_state,
               count(*) AS num_turns, min(started_at) AS started_at,
               sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens
        FROM partial_turns WHERE run_id = ? AND episode_id = ?
        GROUP BY run_id, episode_id
        """,
        [run_id, episode_id],
    )


def find_episode(lw: LiveWarehouse, episode_id: str) -> str | None:
    """The run of an episode id (ids hash the run in, so one matches)."""
    row = lw.one("SELECT run_id FROM episodes WHERE episode_id = ? LIMIT 1", [episode_id])
    if row is None:
        row = lw.one("SELECT run_id FROM partial_turns WHERE episode_id = ? LIMIT 1", [episode_id])
    return row["run_id"] if row else None


def scores(lw: LiveWarehouse, run_id: str, episode_id: str) -> list[dict[str, Any]]:
    """Every verifier's current verdict, newest first, then stale ones (flagged)."""
    cur = lw.fetch(
        "SELECT verifier, score, passed, reason, answer, ground_truth, details, scored_at, "
        "false AS stale FROM scores WHERE run_id = ? AND episode_id = ? ORDER BY scored_at DESC",
        [run_id, episode_id],
    ).rows
    stale = lw.fetch(
        "SELECT verifier, score, passed, reason, answer, ground_truth, details, scored_at, "
        "true AS stale FROM stale_scores WHERE run_id = ? AND episode_id = ? "
        "ORDER BY scored_at DESC",
        [run_id, episode_id],
    ).rows
    return cur + stale


# A turn page shows every stored turn column (warehouse/fields.py: a field added to
# TurnRecord shows up here too) but the ids and the bulky token and egress data.
NOT_SHOWN = frozenset(
    {
        "run_id", "episode_id", "write_id", "num_tool_calls", "prompt_token_ids",
        "completion_token_ids", "completion_logprobs", "prompt_token_ids_prefix_len", "egress",
    }
)  # fmt: skip
TURN_COLUMNS = ", ".join(f'"{c.name}"' for c in stored_turn_columns if c.name not in NOT_SHOWN)


def turns(
    lw: LiveWarehouse,
    run_id: str,
    episode_id: str,
    start: int,
    n: int,
    *,
    write_id: str | None = None,
    partial: bool = False,
) -> list[dict[str, Any]]:
    """Turns start .. start+n-1 of an episode (keyset on turn_index), from the committed
    turns (its attempt's own file when `write_id` names one), or from its journal when
    `partial`."""

    def query() -> str:  # built per attempt: a corrupt own file is left out, then the view
        view = "partial_turns" if partial else "turns"
        if not partial and write_id:
            own = lw.episode_turns_source(run_id, episode_id, write_id)
            if own is not None:
                view = f"({own})"
        return (
            f"SELECT {TURN_COLUMNS} FROM {view} WHERE run_id = ? AND episode_id = ? "
            "AND turn_index >= ? ORDER BY turn_index LIMIT ?"
        )

    return lw.fetch(query, [run_id, episode_id, start, n]).rows


def usage_labels(
    lw: LiveWarehouse, run_id: str, episode_id: str, first: int, last: int
) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(turn_index, call_index) -> its capability labels, for turns first..last."""
    rows = lw.fetch(
        "SELECT turn_index, coalesce(call_index, -1) AS call_index, capability, detail, labeler "
        "FROM usage WHERE run_id = ? AND episode_id = ? AND turn_index BETWEEN ? AND ? "
        "ORDER BY turn_index, call_index, capability",
        [run_id, episode_id, first, last],
    ).rows
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((int(r["turn_index"]), int(r["call_index"])), []).append(r)
    return out


def same_task(
    lw: LiveWarehouse, task_id: str, run_id: str, episode_id: str
) -> list[dict[str, Any]]:
    """Other episodes of the same task: the other mode, other samples, other runs."""
    return lw.fetch(
        """
        SELECT e.run_id, e.episode_id, e.mode, e.sample_index, e.termination, e.num_turns, s.score
        FROM episodes e LEFT JOIN episode_score s USING (run_id, episode_id)
        WHERE e.task_id = ? AND NOT (e.run_id = ? AND e.episode_id = ?)
        ORDER BY e.run_id = ? DESC, e.run_id, e.mode, e.sample_index
        LIMIT 50
        """,
        [task_id, run_id, episode_id, run_id],
    ).rows


# ---- comparing ------------------------------------------------------------------------
def compare_runs(
    lw: LiveWarehouse,
    a: str,
    b: str,
    *,
    a_mode: str | None,
    b_mode: str | None,
    only: str | None,
    page: int,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The tasks of two runs (or two modes of one) paired up, with both verdicts.

    Pairs match on (task, sample) and, unless both modes are given, on mode too.
    `only`: "differ" (verdicts differ), "a_better", "b_better". Returns one page and the
    counts of each outcome over all pairs.
    """
    mode_join = "" if (a_mode and b_mode) else " AND A.mode = B.mode"
    params: list[Any] = [a, b, a]
    a_cond = ""
    b_cond = ""
    if a_mode:
        a_cond = " AND e.mode = ?"
    if b_mode:
        b_cond = " AND e.mode = ?"
    params += [a_mode] if a_mode else []
    params += [b]
    params += [b_mode] if b_mode else []
    only_cond = {
        "differ": "WHERE coalesce(a_score, -1) <> coalesce(b_score, -1)",
        "a_better": "WHERE coalesce(a_score, 0) > coalesce(b_score, 0)",
        "b_better": "WHERE coalesce(b_score, 0) > coalesce(a_score, 0)",
    }.get(only or "", "")
    base = f"""
        WITH s AS ({NEWEST_SCORE.format(runs="?, ?")}),
        A AS (
            SELECT e.task_id, e.domain, e.mode, e.sample_index, e.episode_id, e.termination,
                   e.num_turns, s.score
            FROM episodes e LEFT JOIN s USING (run_id, episode_id) WHERE e.run_id = ?{a_cond}
        ),
        B AS (
            SELECT e.task_id, e.domain, e.mode, e.sample_index, e.episode_id, e.termination,
                   e.num_turns, s.score
            FROM episodes e LEFT JOIN s USING (run_id, episode_id) WHERE e.run_id = ?{b_cond}
        ),
        P AS (
            SELECT coalesce(A.task_id, B.task_id) AS task_id,
                   coalesce(A.domain, B.domain) AS domain,
                   coalesce(A.sample_index, B.sample_index) AS sample_index,
                   A.mode AS a_mode, A.episode_id AS a_episode, A.score AS a_score,
                   A.termination AS a_termination, A.num_turns AS a_turns,
                   B.mode AS b_mode, B.episode_id AS b_episode, B.score AS b_score,
                   B.termination AS b_termination, B.num_turns AS b_turns
            FROM A FULL OUTER JOIN B
              ON A.task_id = B.task_id AND A.sample_index = B.sample_index{mode_join}
        )
    """
    rows = lw.fetch(
        base
        + f"""
        SELECT *, count(*) OVER () AS total FROM P {only_cond}
        ORDER BY task_id, sample_index, coalesce(a_mode, b_mode)
        LIMIT ? OFFSET ?
        """,
        [*params, EPISODES_PER_PAGE, max(0, page) * EPISODES_PER_PAGE],
    ).rows
    counts = (
        lw.one(
            base
            + """
        SELECT count(*) AS pairs,
               count(*) FILTER (WHERE a_episode IS NOT NULL AND b_episode IS NOT NULL) AS both_ran,
               count(*) FILTER (WHERE coalesce(a_score, 0) > coalesce(b_score, 0)) AS a_better,
               count(*) FILTER (WHERE coalesce(b_score, 0) > coalesce(a_score, 0)) AS b_better,
               count(*) FILTER (WHERE a_score >= 1 AND b_score >= 1) AS both_correct,
               count(*) FILTER (WHERE coalesce(a_score, -1) <> coalesce(b_score, -1)) AS differ
        FROM P
        """,
            params,
        )
        or {}
    )
    total = _total(rows)
    stats = {k: int(v or 0) for k, v in counts.items()}
    stats["shown_total"] = total
    return rows, stats


# ---- branches (issue #25) ---------------------------------------------------------------
MAX_BRANCHES = 6  # children shown beside their parent (columns); the rest are counted


def tree_node(lw: LiveWarehouse, run_id: str, episode_id: str) -> dict[str, Any] | None:
    """An episode's row of `episode_tree`: root, parent, depth, branch turn, kind, children."""
    return lw.one(
        "SELECT * FROM episode_tree WHERE run_id = ? AND episode_id = ?", [run_id, episode_id]
    )


def branches(lw: LiveWarehouse, run_id: str, episode_id: str) -> list[dict[str, Any]]:
    """The children of an episode (at most MAX_BRANCHES + 1: one more says there are more),
    earliest branch turn first."""
    return lw.fetch(
        "SELECT * FROM episode_tree WHERE parent_run_id = ? AND parent_episode_id = ? "
        "ORDER BY branch_turn, run_id, episode_id LIMIT ?",
        [run_id, episode_id, MAX_BRANCHES + 1],
    ).rows
