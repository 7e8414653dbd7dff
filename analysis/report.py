"""The run report: one self-contained HTML page and a Markdown summary.

Self-contained means one file you can mail or open offline: plots are PNGs from
matplotlib embedded as base64 data URIs, styles are inline, no scripts, no
network. The same tables go to the Markdown summary and (from the flow) to Prefect
artifacts, so the terminal, the page and the Prefect UI show the same numbers.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from analysis import comparisons, metrics, nightly_report
from analysis.usage_rules import CAPABILITIES
from warehouse.rundata import RunData


@dataclass
class ReportData:
    run_id: str
    accuracy: list[dict[str, Any]]
    usage: list[dict[str, Any]]
    tokens: list[dict[str, Any]]
    turns: list[dict[str, Any]]
    terminations: list[dict[str, Any]]
    ratio: dict[str, float | None]
    meta: dict[str, Any] = field(default_factory=dict)
    # sandbox vs LLM paired by task; pass@k (issue #16: analysis/nightly_report.py)
    modes: list[dict[str, Any]] = field(default_factory=list)
    pass_at_k: list[dict[str, Any]] = field(default_factory=list)
    nightly: nightly_report.NightlySection | None = None  # set by the report flow
    # Base URL of `sandflow view`: table rows link to their episodes there (None: no links)
    viewer_url: str | None = None
    # What the run cost per mode and overall (warehouse.cost.cost_by_mode; set by the
    # report flow); cost_usd None: a model or turn without a price (unknown, never 0)
    cost: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_run(cls, data: RunData, meta: dict[str, Any] | None = None) -> ReportData:
        tok_rows = metrics.episode_tokens(data)
        outcomes = comparisons.outcomes_from_episodes(data.episodes, data.scores)
        return cls(
            run_id=data.run_id,
            accuracy=comparisons.with_intervals(metrics.accuracy(data), comparisons.accuracy_intervals(outcomes)),
            usage=metrics.usage_rates(metrics.turn_labels(data)),
            tokens=metrics.token_summary(tok_rows),
            turns=metrics.turns_summary(data),
            terminations=metrics.terminations(data),
            ratio=metrics.sandbox_llm_ratio(tok_rows),
            meta=dict(meta or {}),
            modes=nightly_report.mode_table(outcomes),
            pass_at_k=nightly_report.pass_at_k_table(outcomes),
        )

    def tables(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        """(key, title, rows) of every table, in page order."""
        return [
            ("accuracy", "Accuracy by domain x mode (%, task-clustered SE and 95% CI)", self.accuracy),
            *(
                [("modes", "Sandbox vs LLM mode, paired by task (points, 95% CI, exact test)", self.modes)]
                if self.modes
                else []
            ),
            *([("pass_at_k", "pass@k (unbiased) and mean@k (%)", self.pass_at_k)] if self.pass_at_k else []),
            ("tokens", "Tokens per episode (mean) and sandbox/LLM ratio", self.tokens),
            *([("cost", "What the run cost (USD; unknown: no price for the model)", cost_table(self.cost))]
              if self.cost else []),
            ("usage", "Capability usage (% of sandbox turns)", self.usage),
            ("turns", "Turns per episode", self.turns),
            ("terminations", "Termination reasons", self.terminations),
        ]


def cost_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cost rows for people: dollars to 1/100 of a cent, "unknown" where a model or
    turn has no price (a blank or a 0 would read as free)."""

    def usd(v: Any) -> str:
        return "unknown" if v is None else f"{v:,.4f}"

    return [{**r, "cost_usd": usd(r.get("cost_usd")), "cost_per_episode": usd(r.get("cost_per_episode"))}
            for r in rows]


# ------------------------------------------------------------------------------ plots
def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _grouped_bars(
    rows: Sequence[dict[str, Any]], value: str, title: str, ylabel: str, ylim: tuple[float, float] | None = None
) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get(value) is not None and r["domain"] != metrics.ALL]
    if not rows:
        return None
    domains = sorted({r["domain"] for r in rows})
    modes = sorted({r["mode"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(domains) + 2), 3.2))
    width = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        vals = [next((r[value] for r in rows if r["domain"] == d and r["mode"] == m), 0) or 0 for d in domains]
        ax.bar([x + i * width for x in range(len(domains))], vals, width, label=m, yerr=_ci_err(rows, m, domains, vals))
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(domains))])
    ax.set_xticklabels(domains, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=8)
    return _png(fig)


def _ci_err(rows: Sequence[dict[str, Any]], mode: str, domains: list[str], vals: list[float]) -> Any:
    """Error bars from ci_low / ci_high when the rows have them (the accuracy table)."""
    by = {r["domain"]: r for r in rows if r["mode"] == mode}
    if not any(by.get(d, {}).get("ci_low") is not None for d in domains):
        return None
    lo, hi = [], []
    for d, v in zip(domains, vals, strict=True):
        low, high = by.get(d, {}).get("ci_low"), by.get(d, {}).get("ci_high")
        lo.append(max(0.0, v - low) if low is not None else 0.0)
        hi.append(max(0.0, high - v) if high is not None else 0.0)
    return [lo, hi]


def _usage_plot(rows: Sequence[dict[str, Any]]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["domain"] != metrics.ALL]
    if not rows:
        return None
    labels = [f"{r['domain']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.2))
    width = 0.8 / len(CAPABILITIES)
    for i, cap in enumerate(CAPABILITIES):
        ax.bar([x + i * width for x in range(len(rows))], [r[cap] for r in rows], width, label=cap)
    ax.set_xticks([x + width for x in range(len(rows))])
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("% of turns")
    ax.set_ylim(0, 100)
    ax.set_title("Sandbox capability usage")
    ax.legend(fontsize=8)
    return _png(fig)


def _terminations_plot(rows: Sequence[dict[str, Any]]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.0))
    labels = [f"{r['mode']}: {r['termination']}" for r in rows]
    ax.barh(labels, [r["episodes"] for r in rows])
    ax.set_xlabel("episodes")
    ax.set_title("Termination reasons")
    return _png(fig)


def plots(rd: ReportData) -> list[tuple[str, str]]:
    """(title, base64 PNG) of every plot that has data."""
    out = []
    for title, b64 in [
        ("Accuracy", _grouped_bars(rd.accuracy, "accuracy", "Accuracy by domain and mode", "% correct", (0, 100))),
        (
            "Tokens",
            _grouped_bars(rd.tokens, "total_tokens", "Tokens per episode (mean)", "tokens"),
        ),
        ("Capability usage", _usage_plot(rd.usage)),
        ("Turns", _grouped_bars(rd.turns, "mean_turns", "Turns per episode (mean)", "turns")),
        ("Terminations", _terminations_plot(rd.terminations)),
    ]:
        if b64:
            out.append((title, b64))
    return out


# ------------------------------------------------------------------------------ text
def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:,.1f}"
    return str(v)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "_no data_\n"
    cols = list(rows[0].keys())
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"


DEFAULT_VIEWER_URL = "http://127.0.0.1:8765"  # `sandflow view`'s default address
_LINKED = ("domain", "mode", "termination", "episodes", "accuracy", *CAPABILITIES)


def viewer_link(viewer_url: str, run_id: str, row: dict[str, Any], col: str) -> str | None:
    """The viewer page listing the episodes behind one cell: the row's domain x mode (and
    termination), and for a capability column the episodes that used it. None for cells
    that stand for no set of episodes."""
    if col not in _LINKED or col not in row:
        return None
    params = {
        k: str(row[k]) for k in ("domain", "mode", "termination") if row.get(k) not in (None, metrics.ALL)
    }
    if col in CAPABILITIES:
        params["usage"] = col
    query = ("?" + urlencode(params)) if params else ""
    return f"{viewer_url.rstrip('/')}/runs/{quote(run_id, safe='')}{query}"


def html_table(
    rows: Sequence[dict[str, Any]], key: str, link: Callable[[dict[str, Any], str], str | None] | None = None
) -> str:
    if not rows:
        return f'<p class="empty" data-table="{key}">no data</p>'
    cols = list(rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)

    def cell(r: dict[str, Any], c: str) -> str:
        text = html.escape(_fmt(r.get(c)))
        href = link(r, c) if link is not None else None
        return f'<td><a href="{html.escape(href)}">{text}</a></td>' if href else f"<td>{text}</td>"

    body = "".join("<tr>" + "".join(cell(r, c) for c in cols) + "</tr>" for r in rows)
    return f'<table data-table="{key}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def headline(rd: ReportData) -> list[str]:
    lines = []
    for r in rd.accuracy:
        if r["domain"] == metrics.ALL:
            lines.append(
                f"{r['mode']} mode: {_fmt(r['accuracy'])}% over {r['episodes']} episodes"
                + (f" ({r['infra_failures']} infrastructure failures)" if r["infra_failures"] else "")
            )
    overall = rd.ratio.get(metrics.ALL)
    if overall is not None:
        lines.append(f"sandbox/LLM tokens per task: {overall:.2f}x (paired over tasks run in both modes)")
    return lines


def to_markdown(rd: ReportData) -> str:
    parts = [f"# sandflow report — run `{rd.run_id}`\n"]
    for k, v in rd.meta.items():
        parts.append(f"- **{k}**: {v}")
    parts += [f"- {line}" for line in headline(rd)]
    parts.append("")
    if rd.nightly is not None:
        parts.append(nightly_report.to_markdown(rd.nightly))
    for _key, title, rows in rd.tables():
        parts.append(f"## {title}\n")
        parts.append(markdown_table(rows))
    return "\n".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;max-width:1100px;color:#1b1f24;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #d0d7de;padding-bottom:.3rem}
table{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}th,td{border:1px solid #d0d7de;padding:.3rem .6rem;text-align:right}
th{background:#f6f8fa}td:first-child,th:first-child{text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:1rem}.plots figure{margin:0}.plots img{max-width:520px;border:1px solid #eee}
.meta{color:#57606a;font-size:.9rem}ul.head li{margin:.2rem 0}
"""


def to_html(rd: ReportData) -> str:
    meta = "".join(
        f"<div><b>{html.escape(str(k))}</b>: {html.escape(str(v))}</div>" for k, v in rd.meta.items()
    )
    heads = "".join(f"<li>{html.escape(h)}</li>" for h in headline(rd))
    figs = "".join(
        f'<figure><img alt="{html.escape(t)}" data-plot="{html.escape(t)}" '
        f'src="data:image/png;base64,{b64}"><figcaption>{html.escape(t)}</figcaption></figure>'
        for t, b64 in plots(rd)
    )
    viewer_url = rd.viewer_url

    def link(row: dict[str, Any], col: str) -> str | None:
        return viewer_link(viewer_url, rd.run_id, row, col) if viewer_url else None

    sections = "".join(
        f"<h2>{html.escape(title)}</h2>{html_table(rows, key, link)}" for key, title, rows in rd.tables()
    )
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>sandflow report — {html.escape(rd.run_id)}</title><style>{_CSS}</style></head><body>"
        f"<h1>sandflow report — run <code>{html.escape(rd.run_id)}</code></h1>"
        f"<div class='meta'>{meta}<div>generated {generated}</div></div>"
        f"<ul class='head'>{heads}</ul>{nightly_report.to_html(rd.nightly) if rd.nightly else ''}"
        f"<h2>Plots</h2><div class='plots'>{figs}</div>{sections}"
        "</body></html>"
    )


def write_report(rd: ReportData, out_dir: Path) -> tuple[Path, Path]:
    """Write report.html and report.md into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    html_path = out_dir / "report.html"
    md_path = out_dir / "report.md"
    html_path.write_text(to_html(rd), encoding="utf-8")
    md_path.write_text(to_markdown(rd), encoding="utf-8")
    return html_path, md_path
