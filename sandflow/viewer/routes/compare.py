"""Comparisons: two episodes turn by turn, and two runs task by task."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from sandflow.viewer import data
from sandflow.viewer.pages import PageError, PagesDep, episode_ref, int_param, run_id_param

router = APIRouter()


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        q = request.query_params
        a, b = episode_ref(q.get("a")), episode_ref(q.get("b"))
        if a is None or b is None:
            raise PageError(
                400,
                "Two episodes needed",
                "open a comparison from an episode page, or give ?a=RUN/EPISODE&b=RUN/EPISODE",
            )
        start = int_param(q.get("start"), 0)
        sides = [pages.episode_context(r, e, start) for r, e in (a, b)]
        n = max(len(s["turns"]) for s in sides)
        rows = []
        for i in range(n):
            rows.append([s["turns"][i] if i < len(s["turns"]) else None for s in sides])
        total = max(s["total_turns"] for s in sides)
        return {"sides": sides, "rows": rows, "start": start, "per_page": data.TURNS_PER_PAGE,
                "total_turns": total, "a": q.get("a"), "b": q.get("b")}  # fmt: skip

    return pages.page("compare.html.j2", request, build)


@router.get("/compare-runs", response_class=HTMLResponse)
def compare_runs(request: Request, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        q = request.query_params
        all_runs, _ = data.runs(pages.lw, limit=500)
        ctx: dict[str, Any] = {"all_runs": all_runs, "pairs": None, "stats": {}}
        a, b = q.get("a") or "", q.get("b") or ""
        a_mode, b_mode = q.get("a_mode") or None, q.get("b_mode") or None
        only = q.get("only") if q.get("only") in ("differ", "a_better", "b_better") else None
        p = int_param(q.get("page"), 0)
        ctx.update(a=a, b=b, a_mode=a_mode or "", b_mode=b_mode or "", only=only or "", page=p,
                   per_page=data.EPISODES_PER_PAGE)  # fmt: skip
        if a and b:
            run_id_param(a)
            run_id_param(b)
            pairs, stats = data.compare_runs(
                pages.lw, a, b, a_mode=a_mode, b_mode=b_mode, only=only, page=p
            )
            ctx.update(pairs=pairs, stats=stats)
        return ctx

    return pages.page("compare_runs.html.j2", request, build)
