"""Runs: the list of runs, one run's episodes (filtered, sorted, paged) and its live part."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from sandflow.viewer import data
from sandflow.viewer.pages import PagesDep, int_param

router = APIRouter()


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        p = int_param(request.query_params.get("page"), 0)
        rows, total = data.runs(
            pages.lw, limit=data.EPISODES_PER_PAGE, offset=p * data.EPISODES_PER_PAGE
        )
        return {"runs": rows, "total": total, "page": p, "per_page": data.EPISODES_PER_PAGE}

    return pages.page("runs.html.j2", request, build)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        ctx = pages.run_context(request, run_id)
        ctx["accuracy"] = data.run_accuracy(pages.lw, ctx["run_id"])
        ctx["cost"] = next(iter(data.run_costs(pages.lw, [ctx["run_id"]])), None)
        ctx["options"] = data.filter_options(pages.lw, ctx["run_id"])
        ctx["score_filters"] = list(data.SCORE_FILTERS)
        ctx["capabilities"] = list(data.CAPABILITY_FILTERS)
        ctx["sorts"] = list(data.SORTS)
        return ctx

    return pages.page("run.html.j2", request, build)


@router.get("/runs/{run_id}/live", response_class=HTMLResponse)
def run_live(request: Request, run_id: str, pages: PagesDep) -> HTMLResponse:
    return pages.page("_run_live.html.j2", request, lambda: pages.run_context(request, run_id))
