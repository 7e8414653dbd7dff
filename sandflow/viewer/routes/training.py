"""Training runs (`sandflow train`, docs/train.md): the list, and one run's curve and steps
from the `training_steps` view. The curve is an inline SVG drawn on the server (numbers
placed by the template, escaped like everything else; no script, nothing fetched)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from sandflow.viewer.pages import PageError, PagesDep

router = APIRouter()

MAX_TRAINING_RUNS = 200
MAX_STEPS_SHOWN = 2000
W, H, PAD = 640, 220, 36  # the curve's box (SVG user units)


@router.get("/training", response_class=HTMLResponse)
def training_runs(request: Request, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        res = pages.lw.fetch(
            """SELECT training_run, count(*) AS steps, max(step) AS last_step,
                      avg(reward_mean) AS reward_mean, sum(groups_with_spread) AS groups_with_spread,
                      sum(groups) AS groups, sum(rollouts) AS rollouts, sum(wall_s) AS wall_s
               FROM training_steps GROUP BY training_run ORDER BY training_run DESC""",
            limit=MAX_TRAINING_RUNS,
        )
        return {"runs": res.rows}

    return pages.page("training_runs.html.j2", request, build)


@router.get("/training/{training_run}", response_class=HTMLResponse)
def training_run(request: Request, training_run: str, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        if len(training_run) > 200:
            raise PageError(404, "No such training run", "a training run's name has at most 200 characters")
        res = pages.lw.fetch(
            """SELECT step, policy_version, reward_mean, reward_spread, pass_rate, groups_with_spread,
                      groups, loss, kl, grad_norm, tokens, rollouts, dropped, wall_s, generation_s,
                      sandbox_s, reward_s, optimizer_s, env_share, run_id
               FROM training_steps WHERE training_run = ? ORDER BY step""",
            [training_run], limit=MAX_STEPS_SHOWN,
        )
        if not res.rows:
            raise PageError(404, "No such training run", f"training run {training_run!r} has no steps in {pages.lw.root}")
        return {"training_run": training_run, "steps": res.rows, "run_id": res.rows[-1]["run_id"],
                "reward": curve(res.rows, "reward_mean", "reward_spread"), "loss": curve(res.rows, "loss")}

    return pages.page("training_run.html.j2", request, build)


def curve(rows: list[dict[str, Any]], key: str, spread: str | None = None) -> dict[str, Any]:
    """Points of `key` over the steps in the SVG box (a band of ± `spread` around them)."""
    pts = [(float(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]
    if not pts:
        return {"points": "", "band": "", "dots": [], "lo": None, "hi": None, "w": W, "h": H}
    sd = {float(r["step"]): float(r.get(spread) or 0.0) for r in rows} if spread else {}
    ys = [y for _, y in pts] + [y + sd.get(x, 0.0) for x, y in pts] + [y - sd.get(x, 0.0) for x, y in pts]
    lo, hi = min(ys), max(ys)
    hi = hi if hi > lo else lo + 1.0
    x0, x1 = pts[0][0], max(pts[-1][0], pts[0][0] + 1.0)

    def at(x: float, y: float) -> tuple[float, float]:
        return (round(PAD + (x - x0) / (x1 - x0) * (W - 2 * PAD), 1),
                round(H - PAD - (y - lo) / (hi - lo) * (H - 2 * PAD), 1))

    line = [at(x, y) for x, y in pts]
    band = [at(x, y + sd.get(x, 0.0)) for x, y in pts] + [at(x, y - sd.get(x, 0.0)) for x, y in reversed(pts)]
    return {"points": " ".join(f"{a},{b}" for a, b in line),
            "band": " ".join(f"{a},{b}" for a, b in band) if spread else "",
            "dots": [{"x": a, "y": b, "step": int(x), "value": y} for (a, b), (x, y) in zip(line, pts, strict=True)],
            "lo": lo, "hi": hi, "w": W, "h": H, "pad": PAD}
