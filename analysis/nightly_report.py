"""The report's nightly part: "Changes since the previous run" and trends over the series.

Built from what warehouse/series.py reads (`SeriesData`: the run's series, its previous
run, the last N runs' outcomes and usage) with analysis/comparisons.py:

- tonight against the previous run of its series, paired on tasks per domain x mode,
  Holm-adjusted; only significant changes are called out, each with the tasks that
  flipped, linked to their trajectories (embedded in the page, folded, so the report
  stays one self-contained file);
- flips inside the noise are listed apart, marked when the task is known to be flaky;
- trend plots over the last N runs: accuracy with its interval, tokens, capability
  usage, infrastructure failures, speed.

Also the per-run extras of the report: sandbox vs LLM mode paired by task, pass@k.
Everything the model wrote is escaped; trajectories were bounded when read.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from analysis.comparisons import (
    ALL,
    DEFAULT_ALPHA,
    ComparisonRow,
    Flaky,
    Night,
    Outcome,
    compare_modes,
    compare_runs,
    describe_change,
    flaky_tasks,
    outcomes_from_rows,
    task_results,
)
from analysis.statistics import Interval, mean_interval, pass_at_k_curve

MAX_LINKED_TASKS = 25  # flipped tasks whose trajectories are embedded
MAX_SAMPLES_LINKED = 2  # episodes per task and side
MAX_EMBEDDED_CHARS = 3_000_000  # trajectories beyond this page budget show their summary only
MAX_LISTED = 30  # flips listed per significant change, and flips within the noise
CAPABILITIES = ("computation", "file_management", "external_resource")


class RegressionFound(RuntimeError):
    """A significant drop since the previous run (`--fail-on-regression`).

    `summary` carries the nightly flow's result, so a caller can still print it.
    """

    def __init__(self, message: str, summary: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.summary = summary or {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.summary))


# ------------------------------------------------------------------ per-run tables
def mode_table(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Sandbox vs LLM mode of one run, paired by task (the paper's main table, with CIs)."""
    return [r.row() for r in compare_modes(outcomes)]


def pass_at_k_table(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """pass@k and mean@k per domain x mode, only when some task has several samples."""
    scored = [o for o in outcomes if o.scored]
    per_task: dict[tuple[str, str], int] = {}
    for o in scored:
        per_task[(o.mode, o.task_id)] = per_task.get((o.mode, o.task_id), 0) + 1
    if not per_task or max(per_task.values()) < 2:
        return []
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in scored:
        groups.setdefault((o.domain, o.mode), []).append(o)
        groups.setdefault((ALL, o.mode), []).append(o)
    rows = []
    for (domain, mode), outs in sorted(
        groups.items(), key=lambda kv: (kv[0][1], kv[0][0] == ALL, kv[0][0])
    ):
        passed = [bool(o.passed) if o.passed is not None else (o.score or 0) >= 1.0 for o in outs]
        curve = pass_at_k_curve(
            [o.task_id for o in outs], passed, [float(o.score or 0.0) for o in outs]
        )
        for p in curve:
            rows.append(
                {
                    "domain": domain,
                    "mode": mode,
                    "k": p.k,
                    "tasks": p.tasks,
                    "left_out": p.left_out,  # tasks with fewer than k samples
                    **p.pass_at_k.columns(100, estimate="pass_at_k", low="pass_ci_low", high="pass_ci_high"),
                    **p.mean_at_k.columns(100, estimate="mean_at_k", low="mean_ci_low", high="mean_ci_high"),
                }
            )
    return rows


# ------------------------------------------------------------------ cost per task
@dataclass(frozen=True)
class CostChange:
    """Cost per task of one mode, tonight against the previous run (issue #28).

    The rule (docs/cost.md, "--fail-on-regression and cost"): a task's cost is the mean
    cost of its episodes in a run (every episode, infrastructure failures too: they were
    paid for); `before` and `after` are the means over the tasks both runs ran whose
    episodes are all priced in both. Tasks only one run ran, or with an unpriced episode,
    are left out (`tasks_left_out`). With `max_increase_pct` set, tonight's cost per task
    above `before * (1 + max_increase_pct / 100)` is a regression (from a free previous
    run, any cost is)."""

    mode: str
    tasks: int
    tasks_left_out: int
    before: float | None
    after: float | None
    max_increase_pct: float | None = None

    @property
    def change_pct(self) -> float | None:
        if self.before is None or self.after is None or self.before == 0:
            return None
        return 100.0 * (self.after - self.before) / self.before

    @property
    def is_regression(self) -> bool:
        if self.max_increase_pct is None or self.before is None or self.after is None:
            return False
        return self.after > self.before * (1 + self.max_increase_pct / 100.0) + 1e-12

    def describe(self) -> str:
        if self.before is None or self.after is None:
            return f"{self.mode}: cost per task unknown (no task priced in both runs)"
        pct = self.change_pct
        rise = "from free" if pct is None and self.after > 0 else f"{pct:+.1f}%" if pct is not None else "+0.0%"
        limit = f", above +{self.max_increase_pct:g}%" if self.is_regression else ""
        return (
            f"{self.mode}: cost per task ${self.before:.4f} -> ${self.after:.4f} ({rise}{limit}, "
            f"{self.tasks} tasks)"
        )

    def row(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tasks": self.tasks,
            "tasks_left_out": self.tasks_left_out,
            "before_usd": None if self.before is None else round(self.before, 6),
            "after_usd": None if self.after is None else round(self.after, 6),
            "change_pct": None if self.change_pct is None else round(self.change_pct, 1),
            "regression": self.is_regression,
        }


def _task_costs(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], float | None]:
    """(run, mode, task) -> the mean cost of its episodes (None: one is unpriced)."""
    out: dict[tuple[str, str, str], float | None] = {}
    for r in rows:
        usd, n = r.get("cost_usd"), int(r.get("episodes") or 0)
        out[(r["run_id"], r["mode"], r["task_id"])] = None if usd is None or n == 0 else float(usd) / n
    return out


def cost_changes(
    rows: Iterable[dict[str, Any]], previous: str, tonight: str, max_increase_pct: float | None
) -> list[CostChange]:
    """One CostChange per mode both runs ran (`rows`: SeriesData.cost)."""
    costs = _task_costs(rows)
    modes = sorted({m for (run, m, _t) in costs if run == tonight} & {m for (run, m, _t) in costs if run == previous})
    out = []
    for mode in modes:
        mine = {t: c for (run, m, t), c in costs.items() if run == tonight and m == mode}
        theirs = {t: c for (run, m, t), c in costs.items() if run == previous and m == mode}
        common = sorted(set(mine) & set(theirs))
        priced = [t for t in common if mine[t] is not None and theirs[t] is not None]
        before = sum(theirs[t] or 0.0 for t in priced) / len(priced) if priced else None
        after = sum(mine[t] or 0.0 for t in priced) / len(priced) if priced else None
        out.append(CostChange(mode, len(priced), len(set(mine) | set(theirs)) - len(priced),
                              before, after, max_increase_pct))
    return out


def cost_per_task(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str], float | None]:
    """(run, mode) -> mean cost per task over all its tasks (None: some task is unpriced):
    the trend plot's points."""
    by: dict[tuple[str, str], list[float | None]] = {}
    for (run, mode, _t), c in _task_costs(rows).items():
        by.setdefault((run, mode), []).append(c)
    return {
        k: None if any(c is None for c in cs) else sum(c or 0.0 for c in cs) / len(cs)
        for k, cs in by.items()
    }


# ------------------------------------------------------------------ the section
@dataclass
class NightlySection:
    run_id: str
    series: dict[str, Any]
    previous_run_id: str | None
    alpha: float
    comparison: list[ComparisonRow] = field(default_factory=list)
    flaky: dict[tuple[str, str], Flaky] = field(default_factory=dict)
    trend: list[dict[str, Any]] = field(default_factory=list)  # one row per run x mode
    usage: dict[str, dict[str, float]] = field(default_factory=dict)  # run -> capability -> %
    runs: list[dict[str, Any]] = field(default_factory=list)  # run_series rows of the window
    # (run_id, episode_id) -> episode with its turns (warehouse.series.read_trajectories)
    trajectories: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    viewer_url: str | None = None  # `sandflow view`: flips link to its side-by-side page
    cost: list[CostChange] = field(default_factory=list)  # cost per task vs the previous run
    cost_trend: dict[tuple[str, str], float | None] = field(default_factory=dict)  # (run, mode)

    def side_by_side(self, f: Any) -> str | None:
        """The viewer's side-by-side page of a flipped task's two episodes, if a viewer is set."""
        if (
            not self.viewer_url
            or not self.previous_run_id
            or not f.episodes_before
            or not f.episodes_after
        ):
            return None
        query = urlencode(
            {
                "a": f"{self.previous_run_id}/{f.episodes_before[0]}",
                "b": f"{self.run_id}/{f.episodes_after[0]}",
            }
        )
        return f"{self.viewer_url.rstrip('/')}/compare?{query}"

    @property
    def previous(self) -> dict[str, Any]:
        return next((r for r in self.runs if r["run_id"] == self.previous_run_id), {})

    @property
    def image_changed(self) -> bool:
        return any(r.get("image_changed") for r in self.runs if r["run_id"] == self.run_id)

    @property
    def prompts_changed(self) -> bool:
        """The run's prompt set (and so its tools) is not its previous run's."""
        return any(r.get("prompts_changed") for r in self.runs if r["run_id"] == self.run_id)

    def regressions(self) -> list[ComparisonRow]:
        return [r for r in self.comparison if r.is_regression]

    def significant(self) -> list[ComparisonRow]:
        return [r for r in self.comparison if r.significant]

    def cost_regressions(self) -> list[CostChange]:
        return [c for c in self.cost if c.is_regression]

    def regression_message(self) -> str | None:
        """One message naming every significant drop and every cost rise past its limit,
        or None."""
        drops, costs = self.regressions(), self.cost_regressions()
        parts = []
        if drops:
            parts.append(
                f"significant drop since run {self.previous_run_id} (Holm-adjusted p < {self.alpha}): "
                + "; ".join(describe_change(r) for r in drops)
            )
        if costs:
            parts.append(
                f"cost per task rose since run {self.previous_run_id}: "
                + "; ".join(c.describe() for c in costs)
            )
        return "; ".join(parts) or None

    def noise_flips(self) -> list[Any]:
        """Flips of the comparisons that are not significant (domain rows only)."""
        return [
            f for r in self.comparison if r.domain != ALL and not r.significant for f in r.flips
        ]

    def table_rows(self) -> list[dict[str, Any]]:
        return [r.row() for r in self.comparison]

    def flips_to_link(self) -> list[tuple[ComparisonRow, Any]]:
        """(row, flip) pairs worth linking: significant rows' flips first, domain rows only."""
        rows = sorted(
            (r for r in self.comparison if r.domain != ALL),
            key=lambda r: (not r.significant, r.mode, r.domain),
        )
        out = [(r, f) for r in rows for f in r.flips]
        return out[:MAX_LINKED_TASKS]

    def episodes_to_link(self) -> dict[str, list[str]]:
        """run_id -> episode ids whose trajectories the page embeds."""
        want: dict[str, list[str]] = {}
        for _row, f in self.flips_to_link():
            if self.previous_run_id:
                want.setdefault(self.previous_run_id, []).extend(
                    f.episodes_before[:MAX_SAMPLES_LINKED]
                )
            want.setdefault(self.run_id, []).extend(f.episodes_after[:MAX_SAMPLES_LINKED])
        return want


def build_section(
    data: Any,
    *,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    max_cost_increase: float | None = None,
) -> NightlySection:
    """`data`: a warehouse.series.SeriesData (run_id, series, previous_run_id, runs,
    outcomes, usage, cost). `max_cost_increase`: the % rise of cost per task that counts
    as a regression (CostChange; None: cost is reported, never a regression)."""
    outcomes = outcomes_from_rows(data.outcomes)
    by_run: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_run.setdefault(o.run_id, []).append(o)
    sec = NightlySection(
        run_id=data.run_id,
        series=dict(data.series),
        previous_run_id=data.previous_run_id,
        alpha=alpha,
        runs=list(data.runs),
    )
    if data.previous_run_id:
        sec.comparison = compare_runs(
            by_run.get(data.previous_run_id, []),
            by_run.get(data.run_id, []),
            alpha=alpha,
            seed=seed,
        )
    order: list[str] = []
    images: dict[str, str | None] = {}
    for r in data.runs:
        if r["run_id"] not in order:
            order.append(r["run_id"])
            images[r["run_id"]] = r.get("image_id") or r.get("image")
    nights = [Night(run, images[run], task_results(by_run.get(run, []))) for run in order]
    sec.flaky = {(f.mode, f.task_id): f for f in flaky_tasks(nights)}
    for r in data.runs:
        if r.get("mode") is None:
            continue
        outs = [o for o in by_run.get(r["run_id"], []) if o.mode == r["mode"]]
        iv = mean_interval(
            [float(o.score) if o.score is not None and o.scored else float("nan") for o in outs],
            [o.task_id for o in outs],
            seed=seed,
        )
        sec.trend.append({**r, "interval": iv})
    for u in data.usage:
        turns = u.get("turns") or 0
        if turns:
            sec.usage.setdefault(u["run_id"], {})[u["capability"]] = 100.0 * u["turns_with"] / turns
    cost_rows = list(getattr(data, "cost", []) or [])
    sec.cost_trend = cost_per_task(cost_rows)
    if data.previous_run_id:
        sec.cost = cost_changes(cost_rows, data.previous_run_id, data.run_id, max_cost_increase)
    return sec


# ------------------------------------------------------------------ links
def anchor(run_id: str, episode_id: str) -> str:
    """A stable, HTML-safe id for an embedded trajectory."""
    return "ep-" + hashlib.sha1(f"{run_id}\0{episode_id}".encode()).hexdigest()[:16]


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


# ------------------------------------------------------------------ markdown
def to_markdown(sec: NightlySection, html_name: str = "report.html") -> str:
    lines = ["## Changes since the previous run\n"]
    if not sec.previous_run_id:
        lines.append(
            f"First run of its series ({_series_text(sec)}): nothing to compare with yet.\n"
        )
        return "\n".join(lines)
    lines.append(
        f"Against `{sec.previous_run_id}` (started {sec.previous.get('started_at')}), "
        f"series {_series_text(sec)}."
        + (" **The sandbox image changed since then.**" if sec.image_changed else "")
        + (" **The prompt set (and its tools) changed since then.**" if sec.prompts_changed else "")
    )
    lines.append("")
    sig = sec.significant()
    if sig:
        lines.append(f"**Significant changes** (Holm-adjusted p < {sec.alpha}):\n")
        for r in sig:
            lines.append(f"- {'▼' if r.direction == 'down' else '▲'} {describe_change(r)}")
            if r.domain == ALL:
                continue
            for f in r.flips[:MAX_LISTED]:
                links = ", ".join(
                    f"[{label}]({html_name}#{anchor(run, ep)})"
                    for label, run, eps in (
                        ("previous", sec.previous_run_id, f.episodes_before),
                        ("tonight", sec.run_id, f.episodes_after),
                    )
                    for ep in eps[:1]
                    if (run, ep) in sec.trajectories
                )
                viewer = sec.side_by_side(f)
                if viewer:
                    links = ", ".join(x for x in (links, f"[side by side]({viewer})") if x)
                lines.append(
                    f"  - `{f.task_id}` {f.direction} ({_pct(f.before)} -> {_pct(f.after)})"
                    + (f": {links}" if links else "")
                )
            if len(r.flips) > MAX_LISTED:
                lines.append(f"  - ... and {len(r.flips) - MAX_LISTED} more: {_more_sql(sec, r)}")
    else:
        lines.append(
            f"No significant change: every difference is within noise "
            f"({len(sec.comparison)} comparisons, Holm-adjusted, alpha = {sec.alpha})."
        )
    lines.append("")
    lines.append(_markdown_rows(sec.table_rows()))
    noise = sec.noise_flips()
    if noise:
        more = f", ... and {len(noise) - MAX_LISTED} more" if len(noise) > MAX_LISTED else ""
        shown = ", ".join(_flip_text(sec, f) for f in noise[:MAX_LISTED])
        lines.append(f"Flips within the noise: {shown}{more}\n")
    if sec.cost:
        lines.append("**Cost per task** (USD, the tasks priced in both runs):\n")
        for c in sec.cost:
            lines.append(f"- {'▲ ' if c.is_regression else ''}{c.describe()}")
        lines.append("")
    return "\n".join(lines)


def _more_sql(sec: NightlySection, r: ComparisonRow) -> str:
    run, domain, mode = (v.replace("'", "''") for v in (sec.run_id, r.domain, r.mode))
    return (
        f"`sandflow sql \"SELECT tasks_down, tasks_up FROM nightly_diff WHERE run_id = '{run}' "
        f"AND domain = '{domain}' AND mode = '{mode}'\"`"
    )


def _series_text(sec: NightlySection, quote: str = "`") -> str:
    s, q = sec.series, quote
    return (
        f"{q}{s.get('series')}{q} / task set {q}{s.get('dataset')}{q} "
        f"({str(s.get('dataset_hash') or '')[:12]}) / model {q}{s.get('model')}{q}"
    )


def _flip_text(sec: NightlySection, f: Any) -> str:
    flaky = sec.flaky.get((f.mode, f.task_id))
    tag = f" (flaky: {flaky.flips} flips in {flaky.runs} runs)" if flaky else ""
    return f"`{f.task_id}` {f.mode} {f.direction}{tag}"


def _markdown_rows(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "_no tasks in common_\n"
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join("—" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ html
_CSS = """
.nightly .sig{margin:.3rem 0}.nightly .down{color:#b42318}.nightly .up{color:#1a7f37}
.nightly details{margin:.4rem 0;border:1px solid #d0d7de;border-radius:4px;padding:.3rem .6rem}
.nightly pre{white-space:pre-wrap;word-break:break-word;background:#f6f8fa;padding:.4rem;margin:.2rem 0;font-size:.8rem;max-height:24rem;overflow:auto}
.nightly .turn{border-top:1px dashed #d0d7de;margin-top:.3rem}
"""


def _e(v: Any) -> str:
    return html.escape("—" if v is None else str(v))


def _table(rows: Sequence[dict[str, Any]], key: str) -> str:
    if not rows:
        return f'<p class="empty" data-table="{key}">no tasks in common</p>'
    cols = list(rows[0])
    head = "".join(f"<th>{_e(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_e(r[c])}</td>" for c in cols) + "</tr>" for r in rows)
    return f'<table data-table="{key}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def to_html(sec: NightlySection) -> str:
    parts = [
        f"<style>{_CSS}</style><section class='nightly' id='changes'>"
        "<h2>Changes since the previous run</h2>"
    ]
    series = _e(_series_text(sec, quote=""))
    if not sec.previous_run_id:
        parts.append(f"<p>First run of its series ({series}): nothing to compare with yet.</p>")
    else:
        parts.append(
            f"<p>Against <code>{_e(sec.previous_run_id)}</code> "
            f"(started {_e(sec.previous.get('started_at'))}), series {series}."
            + (" <b>The sandbox image changed since then.</b>" if sec.image_changed else "")
            + (" <b>The prompt set (and its tools) changed since then.</b>" if sec.prompts_changed else "")
            + "</p>"
        )
        sig = sec.significant()
        if sig:
            parts.append(
                f"<p><b>Significant changes</b> (Holm-adjusted p &lt; {sec.alpha}):</p><ul>"
            )
            for r in sig:
                cls = "down" if r.direction == "down" else "up"
                flips = ""
                if r.domain != ALL and r.flips:
                    items = "".join(f"<li>{_flip_html(sec, f)}</li>" for f in r.flips[:MAX_LISTED])
                    if len(r.flips) > MAX_LISTED:
                        items += f"<li>... and {len(r.flips) - MAX_LISTED} more: {_e(_more_sql(sec, r))}</li>"
                    flips = f"<ul>{items}</ul>"
                parts.append(
                    f"<li class='sig {cls}' data-change='{cls}'>{'▼' if cls == 'down' else '▲'} "
                    f"{_e(describe_change(r))}{flips}</li>"
                )
            parts.append("</ul>")
        else:
            parts.append(
                f"<p data-change='none'>No significant change: every difference is within noise "
                f"({len(sec.comparison)} comparisons, Holm-adjusted, alpha = {sec.alpha}).</p>"
            )
        parts.append(_table(sec.table_rows(), "changes"))
        noise = sec.noise_flips()
        if noise:
            flaky = sum((f.mode, f.task_id) in sec.flaky for f in noise)
            parts.append(
                f"<details class='noise'><summary>{len(noise)} task(s) flipped within the noise "
                f"({flaky} known flaky)</summary><p>"
                + ", ".join(_flip_html(sec, f) for f in noise)
                + "</p></details>"
            )
        if sec.cost:
            parts.append("<h3>Cost per task</h3>" + _table([c.row() for c in sec.cost], "cost"))
        parts.append(_trajectories_html(sec))
    figs = trend_plots(sec)
    if figs:
        n = len({r["run_id"] for r in sec.runs})
        parts.append(f"<h2>Trends over the last {n} runs of this series</h2><div class='plots'>")
        for title, b64 in figs:
            parts.append(
                f'<figure><img alt="{_e(title)}" data-plot="{_e(title)}" src="data:image/png;base64,{b64}">'
                f"<figcaption>{_e(title)}</figcaption></figure>"
            )
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


def _flip_html(sec: NightlySection, f: Any) -> str:
    links = []
    for label, run, eps in (
        ("previous", sec.previous_run_id, f.episodes_before),
        ("tonight", sec.run_id, f.episodes_after),
    ):
        for i, ep in enumerate(eps[:MAX_SAMPLES_LINKED]):
            if run and (run, ep) in sec.trajectories:
                suffix = f" #{i + 1}" if len(eps) > 1 else ""
                links.append(f'<a href="#{anchor(run, ep)}">{label}{suffix}</a>')
    viewer = sec.side_by_side(f)
    if viewer:
        links.append(f'<a class="viewer" href="{_e(viewer)}">side by side</a>')
    flaky = sec.flaky.get((f.mode, f.task_id))
    tag = f" <i>flaky: {flaky.flips} flips in {flaky.runs} runs</i>" if flaky else ""
    return (
        f"<span data-flip='{_e(f.direction)}' data-task='{_e(f.task_id)}'><code>{_e(f.task_id)}</code> "
        f"{_e(f.mode)} {_e(f.direction)} ({_pct(f.before)} → {_pct(f.after)})"
        + (" — " + ", ".join(links) if links else "")
        + f"{tag}</span>"
    )


def _trajectories_html(sec: NightlySection) -> str:
    if not sec.trajectories:
        return ""
    parts = ["<h3>Trajectories of the flipped tasks</h3>"]
    budget = MAX_EMBEDDED_CHARS
    for (run, ep), e in sorted(
        sec.trajectories.items(),
        key=lambda kv: (kv[1].get("task_id") or "", kv[0][0] != sec.previous_run_id),
    ):
        which = "previous" if run == sec.previous_run_id else "tonight"
        parts.append(
            f"<details id='{anchor(run, ep)}' data-episode='{_e(ep)}'><summary><code>{_e(e.get('task_id'))}</code> "
            f"{_e(e.get('mode'))} #{_e(e.get('sample_index'))}, {which} (<code>{_e(run)}</code>): "
            f"score {_e(e.get('score'))}, {_e(e.get('termination'))}, {_e(e.get('num_turns'))} turns</summary>"
            f"<div>answer:<pre>{_e(e.get('answer'))}</pre></div>"
        )
        if e.get("error"):
            parts.append(f"<div>error:<pre>{_e(e['error'])}</pre></div>")
        body = _turns_html(e.get("turns") or [])
        if len(body) > budget:
            body = "<p><i>turns left out: the page's size bound for trajectories is reached</i></p>"
        budget -= len(body)
        parts.append(body)
        parts.append("</details>")
    return "".join(parts)


def _turns_html(turns: Sequence[dict[str, Any]]) -> str:
    parts = []
    for t in turns:
        parts.append(f"<div class='turn'><b>turn {_e(t.get('turn_index'))}</b>")
        if t.get("reasoning_content"):
            parts.append(f"<div>reasoning:<pre>{_e(t['reasoning_content'])}</pre></div>")
        if t.get("assistant_content"):
            parts.append(f"<pre>{_e(t['assistant_content'])}</pre>")
        for c in t.get("tool_calls") or []:
            parts.append(
                f"<div>→ <code>{_e(c.get('name'))}</code><pre>{_e(c.get('arguments'))}</pre></div>"
            )
        for o in t.get("observations") or []:
            status = f"exit {o.get('exit_code')}" + (", timed out" if o.get("timed_out") else "")
            parts.append(f"<div>← {_e(status)}<pre>{_e(o.get('content'))}</pre></div>")
        parts.append("</div>")
    return "".join(parts)


# ------------------------------------------------------------------ trend plots
def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _runs_axis(sec: NightlySection) -> tuple[list[str], list[str]]:
    order: list[str] = []
    labels: list[str] = []
    for r in sec.runs:
        if r["run_id"] in order:
            continue
        order.append(r["run_id"])
        started = r.get("started_at")
        label = (
            started.strftime("%m-%d %H:%M")
            if isinstance(started, datetime)
            else str(r.get("run_number"))
        )
        labels.append(label + (" *" if r["run_id"] == sec.run_id else ""))
    return order, labels


def _lines(
    sec: NightlySection,
    title: str,
    ylabel: str,
    series: Iterable[tuple[str, list[float | None], list[tuple[float, float] | None] | None]],
) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order, labels = _runs_axis(sec)
    fig, ax = plt.subplots(figsize=(max(4.5, 0.55 * len(order) + 2.5), 3.0))
    drew = False
    for name, ys, bands in series:
        xs = [i for i, y in enumerate(ys) if y is not None]
        if not xs:
            continue
        drew = True
        vals = [float(ys[i] or 0.0) for i in xs]
        if bands:
            lo = [vals[j] - bands[i][0] if bands[i] else 0 for j, i in enumerate(xs)]  # type: ignore[index]
            hi = [bands[i][1] - vals[j] if bands[i] else 0 for j, i in enumerate(xs)]  # type: ignore[index]
            ax.errorbar(xs, vals, yerr=[lo, hi], marker="o", capsize=3, label=name)
        else:
            ax.plot(xs, vals, marker="o", label=name)
    if not drew:
        plt.close(fig)
        return None
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _png(fig)


def trend_plots(sec: NightlySection) -> list[tuple[str, str]]:
    """(title, base64 PNG) per trend plot; none with fewer than two runs."""
    order, _labels = _runs_axis(sec)
    if len(order) < 2:
        return []
    modes = sorted({r["mode"] for r in sec.trend})

    def per_mode(value: str, scale: float = 1.0) -> list[tuple[str, list[float | None], None]]:
        out = []
        for m in modes:
            by = {r["run_id"]: r for r in sec.trend if r["mode"] == m}
            out.append(
                (
                    m,
                    [
                        None if by.get(run, {}).get(value) is None else by[run][value] * scale
                        for run in order
                    ],
                    None,
                )
            )
        return out

    acc = []
    for m in modes:
        by = {r["run_id"]: r["interval"] for r in sec.trend if r["mode"] == m}
        ivs: list[Interval | None] = [by.get(run) for run in order]
        ys = [None if iv is None or iv.estimate is None else 100 * iv.estimate for iv in ivs]
        bands = [
            (100 * iv.low, 100 * iv.high)
            if iv is not None and iv.low is not None and iv.high is not None
            else None
            for iv in ivs
        ]
        acc.append((m, ys, bands))
    usage = [
        (
            cap,
            [sec.usage.get(run, {}).get(cap) if run in sec.usage else None for run in order],
            None,
        )
        for cap in CAPABILITIES
    ]
    out = []
    for title, b64 in [
        ("Accuracy trend", _lines(sec, "Accuracy (95% CI)", "% correct", acc)),
        (
            "Tokens trend",
            _lines(sec, "Tokens per episode (mean)", "tokens", per_mode("avg_tokens")),
        ),
        ("Usage trend", _lines(sec, "Sandbox capability usage", "% of turns", usage)),
        (
            "Infra failures trend",
            _lines(sec, "Infrastructure failures", "episodes", per_mode("infra_failures")),
        ),
        ("Speed trend", _lines(sec, "Episode wall time (mean)", "seconds", per_mode("avg_wall_s"))),
        (
            "Cost trend",
            _lines(
                sec,
                "Cost per task (mean; unpriced runs left out)",
                "USD",
                [(m, [sec.cost_trend.get((run, m)) for run in order], None) for m in modes],
            ),
        ),
    ]:
        if b64:
            out.append((title, b64))
    return out
