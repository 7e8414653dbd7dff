"""One episode: its turns page by page, the live part of a running one, and the short
link /episode/{id} that finds its run."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from sandflow.viewer import data
from sandflow.viewer.pages import PageError, PagesDep, episode_id_param, int_param

router = APIRouter()


@router.get("/runs/{run_id}/episodes/{episode_id}", response_class=HTMLResponse)
def episode_page(request: Request, run_id: str, episode_id: str, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        start = int_param(request.query_params.get("start"), 0)
        ctx = pages.episode_context(run_id, episode_id, start)
        task = (ctx["ep"] or ctx["partial"] or {}).get("task_id")
        ctx["others"] = (
            data.same_task(pages.lw, task, ctx["run_id"], ctx["episode_id"]) if task else []
        )
        ctx["tree"] = data.tree_node(pages.lw, ctx["run_id"], ctx["episode_id"]) if ctx["ep"] else None
        return ctx

    return pages.page("episode.html.j2", request, build)


@router.get("/runs/{run_id}/episodes/{episode_id}/live", response_class=HTMLResponse)
def episode_live(request: Request, run_id: str, episode_id: str, pages: PagesDep) -> HTMLResponse:
    start = int_param(request.query_params.get("start"), 0)
    return pages.page(
        "_episode_live.html.j2", request, lambda: pages.episode_context(run_id, episode_id, start)
    )


@router.get("/episode/{episode_id}")
def find_episode(request: Request, episode_id: str, pages: PagesDep) -> Response:
    try:
        pages.lw.touch()
        eid = episode_id_param(episode_id)
        run = data.find_episode(pages.lw, eid)
        if run is None:
            raise PageError(404, "No such episode", f"no run has an episode {eid!r}")
    except PageError as exc:
        return pages.error(request, exc)
    turn = request.query_params.get("turn")
    url = f"/runs/{run}/episodes/{eid}"
    if turn is not None and turn.isdigit():
        t = int(turn)
        start = (t // data.TURNS_PER_PAGE) * data.TURNS_PER_PAGE
        url += (f"?start={start}" if start else "") + f"#turn-{t}"
    return RedirectResponse(url, status_code=303)
